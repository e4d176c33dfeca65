"""A real S3 server on loopback for the tests: moto's server mode
(`python -m moto.server`, from requirements-s3's test line in .ci/run), in a
process of its own, so a test can stop it mid-read as a store that goes away.

Requests are signed and sent over HTTP like any S3 endpoint's. moto accepts any
credentials until asked to check them (`check_credentials`: its
/moto-api/reset-auth, the server-side INITIAL_NO_AUTH_ACTION_COUNT, set to 0):
from then on a key moto's IAM does not know is InvalidAccessKeyId and a wrong
secret SignatureDoesNotMatch, as on AWS."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Dict, Tuple

import pytest

from common.ports import free_port

BUCKET = "imagenet"
REGION = "us-east-1"
START_DEADLINE_S = 60.0  # moto imports Flask and its backends: 2 s here, much more on a loaded machine
START_ATTEMPTS = 3

# The credentials every test client and training process uses: boto3's own variables, nothing from the
# user's ~/.aws (AWS_CONFIG_FILE and AWS_SHARED_CREDENTIALS_FILE point at files that are not there).
TEST_KEY_ID, TEST_SECRET = "AKIATESTTESTTESTTEST", "test-secret-not-for-printing"


def use_credentials(environment, key_id: str = TEST_KEY_ID, secret: str = TEST_SECRET) -> None:
    """Set these credentials in `environment` (os.environ, or a pytest MonkeyPatch): boto3's own variables,
    nothing from the user's ~/.aws, AWS_PROFILE or AWS_ENDPOINT_URL."""
    setting = {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": REGION,
               "AWS_CONFIG_FILE": os.devnull + ".absent", "AWS_SHARED_CREDENTIALS_FILE": os.devnull + ".absent",
               "AWS_EC2_METADATA_DISABLED": "true"}
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        environment.delenv(name, raising=False) if hasattr(environment, "delenv") else environment.pop(name, None)
    for name, value in setting.items():
        environment.setenv(name, value) if hasattr(environment, "setenv") else environment.__setitem__(name, value)


def moto_missing() -> str:
    """Why these tests cannot run here, or '' when they can."""
    for module in ("boto3", "moto.server", "flask"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -r requirements-s3.txt 'moto[server]')"
    return ""


class S3Server:
    """moto_server on 127.0.0.1 at a free port, until stop()."""

    def __init__(self):
        # free_port's port may be taken by another process (another test's server or rendezvous) before moto binds
        # it: moto then exits, and what answers there is not moto, or another test's moto. Another port is tried, a few times.
        for _ in range(START_ATTEMPTS):
            self.port = free_port()
            self.endpoint_url = f"http://127.0.0.1:{self.port}"
            self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                             str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
            deadline = time.monotonic() + START_DEADLINE_S
            while self.process.poll() is None and time.monotonic() < deadline and not self._is_moto():
                time.sleep(0.1)
            if self.process.poll() is None and self._is_moto() and self._listening_socket_is_ours():
                return
            self.stop()
        raise RuntimeError(f"moto_server did not start within {START_DEADLINE_S} s, {START_ATTEMPTS} times")

    def _listening_socket_is_ours(self) -> bool:
        """Whether the socket listening at the port is this server's process's, not another test's moto (Linux's
        /proc: the socket's inode among the process's descriptors; True where /proc cannot say)."""
        try:
            inodes = {fields[9] for fields in (line.split() for line in open("/proc/net/tcp").readlines()[1:])
                      if fields[1].endswith(f":{self.port:04X}") and fields[3] == "0A"}  # 0A: LISTEN
            held = {os.readlink(f"/proc/{self.process.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{self.process.pid}/fd")}
        except OSError:
            return True
        return any(f"socket:[{inode}]" in held for inode in inodes)

    def _is_moto(self) -> bool:
        """Whether moto answers at the port: its S3 lists the buckets (an empty list at first)."""
        try:
            with urllib.request.urlopen(f"{self.endpoint_url}/", timeout=5) as answer:
                return b"ListAllMyBucketsResult" in answer.read()
        except OSError:  # not listening yet, or another server that answers otherwise
            return False

    def client(self, key_id: str = TEST_KEY_ID, secret: str = TEST_SECRET):
        import boto3
        return boto3.session.Session(aws_access_key_id=key_id, aws_secret_access_key=secret,
                                     region_name=REGION).client("s3", endpoint_url=self.endpoint_url)

    def upload(self, objects: Dict[str, bytes], bucket: str = BUCKET) -> None:
        client = self.client()
        if bucket not in [entry["Name"] for entry in client.list_buckets().get("Buckets", ())]:
            client.create_bucket(Bucket=bucket)
        for key, data in objects.items():
            client.put_object(Bucket=bucket, Key=key, Body=data)

    def iam_user(self, name: str = "trainer") -> Tuple[str, str]:
        """A user allowed every S3 action: (its access key id, its secret), made while moto checks nothing."""
        import boto3
        iam = boto3.session.Session(aws_access_key_id=TEST_KEY_ID, aws_secret_access_key=TEST_SECRET,
                                    region_name=REGION).client("iam", endpoint_url=self.endpoint_url)
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName=name, PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def check_credentials(self, check: bool) -> None:
        """From now on, check every request's credentials against moto's IAM (or stop checking)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset-auth", method="POST",
                                         data=b"0" if check else b"inf", headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the server gone at once, as a crashed store is
        self.process.wait()


@contextlib.contextmanager
def serving(objects: Dict[str, bytes]):
    """A server holding `objects` (key: bytes, in BUCKET), with the tests' credentials in this process's
    environment (and so in every process it starts), until the block ends: a module's fixture."""
    with pytest.MonkeyPatch.context() as environment:
        use_credentials(environment)
        server = S3Server()
        try:
            server.upload(objects)
            yield server
        finally:
            server.stop()
