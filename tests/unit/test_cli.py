"""The command line's limits and messages (common.cli, in-process): a size or
count this machine could never hold is one line naming its flag before
anything is allocated or started, a path is said to be what it is, and no
line quotes a credential a user put in a URL."""
import pytest

from common import cli
from common.errors import UsageError, without_credentials
from helpers import make_image_folder, memory_capped


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return str(make_image_folder(tmp_path_factory.mktemp("cli") / "data", classes=2, train_per_class=1,
                                 val_per_class=1, size=8))


# --- one value must never take the machine's memory ---

@pytest.mark.parametrize("flags, message", [
    (["-b", str(10**15)], r"^argument -b/--batch-size: a batch of 1000000000000000 224x224 images as float32 input "
                          r"\(-b 1000000000000000 at --image-size 224\) would take [\d.]+ TB, more than the "),
    (["--image-size", str(10**9), "--val-resize", str(10**9)],
     r"^argument --image-size: one 1000000000x1000000000 image as float32 input would take [\d.]+ TB, more than the "),
    (["--val-resize", str(10**9)],
     r"^argument --val-resize: one validation image resized to 1000000000x1000000000 pixels would take [\d.]+ TB"),
    (["-j", str(10**12)], r"^argument -j/--workers: -j 1000000000000 data-loading processes x --nproc-per-node 1 "
                          r"on this node, with batches of -b 128 at --image-size 224 would take"),
])
def test_a_size_or_count_no_machine_holds_is_one_line_before_anything_is_allocated(flags, message):
    with memory_capped(), pytest.raises(UsageError, match=message + r".* of memory this machine gives the job$"):
        cli.parse("ddp", ["--synthetic", *flags])
    cfg = cli.parse("ddp", ["--synthetic", "-b", "256", "--image-size", "224", "-j", "8"])  # sizes that fit
    assert (cfg.batch_size, cfg.image_size, cfg.workers) == (256, 224, 8)


@pytest.mark.parametrize("flag, value, message", [
    # Sampled every nanosecond, io.csv's rows (kept until the epoch ends) would grow by megabytes a second.
    ("--io-interval", "1e-9", "argument --io-interval: expected 0 (off) or at least 0.1 seconds, got 1e-9"),
    # Past timedelta's range and DDP's 64-bit byte count: tracebacks once training began.
    ("--dist-timeout", "1e300", "argument --dist-timeout: expected a positive number of seconds, at most a year "
                                "(31536000), got 1e300"),
    ("--bucket-cap-mb", "1e300", "argument --bucket-cap-mb: expected a positive size in MiB, at most 1048576 "
                                 "(1 TiB), got 1e300"),
])
def test_values_that_would_fail_or_grow_without_bound_later_are_refused_now(flag, value, message):
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        cli.parse("ddp", ["--synthetic", flag, value])
    assert cli.parse("ddp", ["--synthetic", "--io-interval", "0"]).io_interval == 0  # off, as before


# --- a path is said to be what it is ---

def test_a_directory_given_to_resume_is_called_one_and_the_ways_to_continue_are_named(data, tmp_path):
    run_dir = tmp_path / "runs" / "my_run"
    run_dir.mkdir(parents=True)
    continue_there = rf", or --resume auto --logdir {tmp_path / 'runs'} --run-name my_run to continue the run there$"
    with pytest.raises(UsageError, match=rf"^argument --resume: {run_dir} is a directory, not a checkpoint file; give "
                                         rf"a checkpoint file \(it holds no checkpoint.pth.tar, a run directory's "
                                         rf"newest\){continue_there}"):
        cli.parse("nd", [data, "--resume", str(run_dir)])
    (run_dir / "checkpoint.pth.tar").write_bytes(b"")
    with pytest.raises(UsageError, match=rf"^argument --resume: {run_dir} is a directory, not a checkpoint file; give "
                                         rf"a file in it \(its newest: {run_dir}/checkpoint.pth.tar\){continue_there}"):
        cli.parse("nd", [data, "--resume", str(run_dir)])


def test_a_directory_for_file_list_and_a_file_for_data_are_called_what_they_are(data, tmp_path):
    with pytest.raises(UsageError, match=rf"^argument --file-list: {tmp_path} is a directory; give the list file"):
        cli.parse("nd", [data, "--file-list", str(tmp_path)])
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(UsageError, match=rf"^DATA {a_file}: not a directory \(the dataset folder, holding train/ "
                                         rf"and val/\)$"):
        cli.parse("nd", [str(a_file)])


@pytest.mark.parametrize("flag", ["--logdir", "--resume", "--file-list"])
def test_a_url_given_for_a_path_is_refused_without_its_credentials(data, flag):
    # Taken for a path, it became local folders named after the secret, printed in every line naming the run.
    with pytest.raises(UsageError, match=rf"^argument {flag}: 's3://\*\*\*@bucket/runs' is a URL; give a path on a "
                                         rf"local or mounted file system$"):
        cli.parse("nd", [data, flag, "s3://AKIAEXAMPLE:s3cret@bucket/runs"])


# --- credentials are never printed ---

@pytest.mark.parametrize("text, shown", [
    ("tcp://alice:s3cret@node0:29500", "tcp://***@node0:29500"),
    ("got 'tcp://alice:p@ss/w@rd@node0:29500' (see --help)", "got 'tcp://***@node0:29500' (see --help)"),
    ("https://ghp_TOKEN@github.com/x", "https://***@github.com/x"),  # a token alone is a credential too
    ("--address=alice:s3cret@head:6379", "--address=***@head:6379"),  # no scheme: user:password@
])
def test_credentials_in_urls_are_shown_as_stars(text, shown):
    assert without_credentials(text) == shown
    unchanged = "tcp://[::1]:29500 /data/a:b@c user@host node0:29500"  # no credential in it
    assert without_credentials(unchanged) == unchanged


@pytest.mark.parametrize("script, argv", [
    ("ddp", ["--synthetic", "--dist-url", "tcp://alice:s3cret@node0:29500"]),  # the form is checked at once
    ("ddp", ["--synthetic", "--dist-url", "http://alice:s3cret@node0:29500"]),  # not tcp://
    ("ddp", ["--synthetic", "--world-size", "tcp://alice:s3cret@node0:29500"]),  # argparse's "invalid value"
    ("nd", ["--synthetic", "--dist-url=tcp://alice:s3cret@node0:29500"]),  # argparse's "unrecognized"
    ("nd", ["tcp://alice:s3cret@node0:29500"]),  # DATA
])
def test_a_refused_credential_is_not_printed(script, argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.run(lambda: cli.parse(script, argv))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and len(err.splitlines()) == 1, err
    assert "***@node0:29500" in err and "s3cret" not in err and "alice" not in err
