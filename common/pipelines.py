"""Image pipelines: from an image file to the tensor a model takes.

Four backends (--data-backend), one set of random parameters. The
training crop and flip are drawn the same way by all four (torchvision's
RandomResizedCrop.get_params, then one draw for the flip), from the torch
generator common.data seeds per image, so for one seed every backend cuts
the same box of the same image; only the resampling arithmetic differs
(tests/unit/test_pipelines.py bounds the pixel difference).

  pil          the plain reference: Pillow decodes, crops and resizes, then
               ToTensor and Normalize make float32 in the data-loading
               worker (what torchvision's ImageNet example does).
  torchvision  the default: JPEGs are decoded straight into a tensor by
               the JPEG decoder chosen once per run (JpegDecoder: TorchCodec
               where it is installed and works, else torchvision.io, else
               Pillow; all three are libjpeg-turbo), or by Pillow at
               1/2, 1/4 or 1/8 size in the DCT domain (its draft mode)
               when the crop is shrunk at least that much anyway; cropping,
               resizing and flipping run on uint8 tensors. Workers hand
               over uint8 batches (4x fewer bytes than float32 through
               shared memory, and pinned memory, to the GPU) in the
               channels-last layout the decoder and the resize leave
               them in (stack_images); conversion to float, normalisation
               and the model's memory format happen on the device (DeviceInput).
               Other formats (PNG, ...) and JPEGs torchvision cannot read
               are decoded by Pillow, then follow the same tensor path.
  gpu          workers only read the file and draw the crop; nvJPEG decodes
               the batch on the GPU (the chosen decoder's decode_jpeg(...,
               device="cuda")), where it is also cropped and resized. Files
               that are not complete JPEGs take the torchvision path in the worker.
  dali         the gpu backend's workers (DaliImages); NVIDIA DALI decodes
               the crop's region of each JPEG on the device, resizes and
               flips it (common.dali; DALI itself is imported only for this
               backend).

--auto-augment and --random-erase (common.augment) follow the crop and flip
on every backend but dali, drawing next from the same generator: on the
crop's uint8 tensor in the worker (pil: then normalised and erased there),
or for the gpu backend on the device, from the generator's state the worker
kept with the file (Encoded.generator_state, replayed).

Reading files and Pillow's decode, and bad images: common.image_files; the
JPEG decoders and headers: common.jpeg_decoders; what happens on the device
(GPU decoding of the gpu backend's batches, normalisation, memory format,
prefetching): common.device_input.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision import transforms
from torchvision.transforms.v2 import functional as tensor_ops

from common.augment import ImageAugmentation
from common.image_files import decode_rgb, large_pixels, load_rgb, open_image, read_file, uint8_tensor
from common.jpeg_decoders import EXIF_ORIENTATION, JPEG_END, JpegDecoder, JpegHeader, choose_jpeg_decoder, jpeg_header

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's aspect-ratio range
# What normalisation maps to 0, in gray levels, rounded: --random-erase's value in a uint8 image (augment).
MEAN_GRAY_LEVELS = tuple(round(255 * mean) for mean in IMAGENET_MEAN)


class Loaded(NamedTuple):
    """What a pipeline makes of one file (a Sample's makings)."""

    image: object  # a tensor, or for the gpu backend an Encoded
    file_bytes: int  # read from storage
    large_pixels: int = 0  # see large_pixels


def stack_images(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """3 x H x W images as one N x 3 x H x W batch in channels-last memory
    (N x H x W x 3 underneath). The images come out of Geometry.apply in that
    layout on the CPU, so stacking them is a copy of whole images, where
    torch.stack's default NCHW batch would gather every byte: 5-10x slower,
    45-80 us an image at 224 px, 3-5% of the torchvision backend's time. The device
    then turns them into float batches in either memory format
    (DeviceInput). default_collate does the stacking: in a data-loading
    worker it builds the batch in shared memory."""
    return default_collate([image.permute(1, 2, 0) for image in images]).permute(0, 3, 1, 2)


# The reference pipelines (--data-backend pil): Pillow all the way, float32 out of the worker.

def train_transform(image_size: int, crop_scale: Tuple[float, float] = (0.08, 1.0), hflip: float = 0.5,
                    augmentation: Optional[ImageAugmentation] = None):
    geometry = [transforms.RandomResizedCrop(image_size, scale=crop_scale, ratio=CROP_RATIO),
                transforms.RandomHorizontalFlip(hflip)]
    normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    if augmentation is None:
        return transforms.Compose([*geometry, transforms.ToTensor(), normalize])
    # The policy on the crop's uint8 tensor, as the other backends run it; the erasing on the normalised image.
    policy, erasing = augmentation.policy_transform(), augmentation.erasing([0.0])
    return transforms.Compose([*geometry, transforms.PILToTensor(), *filter(None, [policy]),
                               transforms.ConvertImageDtype(torch.float32), normalize, *filter(None, [erasing])])


def val_transform(image_size: int, val_resize: int):
    return transforms.Compose([
        transforms.Resize(val_resize),
        transforms.CenterCrop(image_size),
        transforms.ToTensor(),
        transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


class ImagePipeline:
    """A backend's pipeline: an image's encoded bytes and its name (for
    messages) -> Loaded (from_bytes), whoever read them (a file, a shard:
    common.data's readers); called with a path, it reads the file first."""

    def __call__(self, path: str) -> Loaded:
        return self.from_bytes(read_file(path), path)

    def from_bytes(self, encoded: bytes, name: str) -> Loaded:
        raise NotImplementedError


class PILImages(ImagePipeline):
    """--data-backend pil: (normalised float image, bytes read)."""

    def __init__(self, transform):
        self.transform = transform

    def from_bytes(self, encoded: bytes, name: str) -> Loaded:
        image = decode_rgb(encoded, name)
        return Loaded(self.transform(image), len(encoded), large_pixels(image.size))


# The fast pipelines: uint8 tensors, one geometry for every decoder.

@dataclasses.dataclass(frozen=True)
class Geometry:
    """What becomes of one image: the training crop box (in the full-size
    image's pixels) and flip, or, with `crop` None, validation's resize of
    the short side to `val_resize` and centre crop."""

    image_size: int
    crop: Optional[Tuple[int, int, int, int]] = None  # (top, left, height, width)
    flip: bool = False
    val_resize: int = 0

    def reduction(self, width: int, height: int) -> int:
        """The largest DCT scaling 1, 2, 4 or 8 that still leaves at least
        the output's pixels for the crop: libjpeg then skips the inverse DCT,
        upsampling and colour work of the pixels it does not produce (its
        entropy decoding, most of the time on photo-like files, stays)."""
        if self.crop is None:
            return 1  # validation decodes at full size, as the reference does: top-1 stays comparable
        for factor in (8, 4, 2):
            if min(self.crop[2], self.crop[3]) >= factor * self.image_size:
                return factor
        return 1

    def apply(self, image: torch.Tensor, full_width: int, full_height: int) -> torch.Tensor:
        """Crop, resize and flip a 3 x H x W uint8 image (on any device),
        which may be a 1/k-size decode of a full_width x full_height file."""
        size = [self.image_size, self.image_size]
        if self.crop is None:
            image = tensor_ops.resize(_interleaved(image.unsqueeze(0)), [self.val_resize], antialias=True)[0]
            return tensor_ops.center_crop(image, size)
        top, left, height, width = self.crop
        scale_y, scale_x = image.shape[-2] / full_height, image.shape[-1] / full_width
        if scale_x != 1.0 or scale_y != 1.0:  # a reduced decode: the same box, in its pixels
            top, left = int(round(top * scale_y)), int(round(left * scale_x))
            height = max(1, min(int(round(height * scale_y)), image.shape[-2] - top))
            width = max(1, min(int(round(width * scale_x)), image.shape[-1] - left))
        crop = _interleaved(image[..., top:top + height, left:left + width].unsqueeze(0))
        image = tensor_ops.resize(crop, size, antialias=True)[0]
        return tensor_ops.horizontal_flip(image) if self.flip else image


def _interleaved(images: torch.Tensor) -> torch.Tensor:
    """On the CPU, N x 3 x H x W as one channels-last block (a copy only
    where it is not one already: a crop's rows): the antialiased uint8
    resize has a vectorised CPU kernel for that layout, 1.2-1.5x faster than
    for planar channels, and its output keeps the layout (see
    stack_images). The CUDA kernel works on planar channels (it would copy
    a channels-last block back): GPU images stay as they are."""
    if images.device.type != "cpu":
        return images
    return images.contiguous(memory_format=torch.channels_last)


def _tensor_decodable(image: Image.Image) -> bool:
    """A JPEG the tensor decoders read as Pillow does: 8-bit grayscale,
    colour or CMYK, stored upright. TorchCodec turns an image by its EXIF
    orientation, which Pillow and torchvision leave alone (as torchvision's
    ImageNet reference does): such files are Pillow's, so every backend cuts
    the same crop from the same pixels."""
    if image.format != "JPEG" or image.mode not in ("L", "RGB", "CMYK"):
        return False
    return "exif" not in image.info or image.getexif().get(EXIF_ORIENTATION, 1) == 1


class TensorImages(ImagePipeline):
    """--data-backend torchvision: (3 x S x S uint8 image, bytes
    read). With `train`, the crop and flip are drawn from torch's generator
    exactly as the reference's RandomResizedCrop and RandomHorizontalFlip
    draw them, then `augmentation` (training only) runs on the uint8 crop."""

    def __init__(self, train: bool, image_size: int, crop_scale: Sequence[float] = (0.08, 1.0),
                 hflip: float = 0.5, val_resize: int = 256, reduced_decode: bool = True,
                 decoder: Optional[JpegDecoder] = None, augmentation: Optional[ImageAugmentation] = None):
        self.train = train
        self.augment = augmentation.uint8(MEAN_GRAY_LEVELS) if augmentation is not None and train else None
        self.image_size = image_size
        self.crop_scale = list(crop_scale)
        self.hflip = hflip
        self.val_resize = val_resize
        self.reduced_decode = reduced_decode
        self.decoder = decoder or choose_jpeg_decoder()  # None: chosen here (the training loaders pass theirs)

    def geometry(self, width: int, height: int) -> Geometry:
        if not self.train:
            return Geometry(self.image_size, val_resize=self.val_resize)
        # get_params reads only the shape of what it is given: a meta tensor has one and no memory
        shape_only = torch.empty((3, height, width), device="meta")
        box = transforms.RandomResizedCrop.get_params(shape_only, self.crop_scale, list(CROP_RATIO))
        flip = bool(torch.rand(1) < self.hflip)  # RandomHorizontalFlip's draw
        return Geometry(self.image_size, crop=box, flip=flip)

    def from_bytes(self, encoded: bytes, name: str) -> Loaded:
        return self.load(encoded, name)

    def load(self, encoded: bytes, path: str) -> Loaded:
        """The file's image from its bytes: the hand-read header where it
        will do, else Pillow's look at the file."""
        header = self.plain_header(encoded)
        if header is not None:
            image = self.finish(encoded, path, header.size, tensor_decodable=True)
            return Loaded(image, len(encoded), 0)
        with open_image(encoded, path) as opened:
            image = self.finish(encoded, path, opened.size, _tensor_decodable(opened), opened)
            return Loaded(image, len(encoded), large_pixels(opened.size))

    def plain_header(self, encoded: bytes) -> Optional[JpegHeader]:
        """The hand-read header of a JPEG that needs no look from Pillow, else
        None: not a JPEG (or an odd one), an image above Pillow's
        decompression-bomb limit (Pillow refuses those above twice it), or one
        with EXIF that the decoder would turn by its orientation."""
        header = jpeg_header(encoded)
        if header is None or large_pixels(header.size) or (header.exif and self.decoder.name == "torchcodec"):
            return None
        return header

    def finish(self, encoded: bytes, path: str, size: Tuple[int, int], tensor_decodable: bool,
               opened: Optional[Image.Image] = None) -> torch.Tensor:
        """The file's training or validation image (3 x S x S uint8), from
        its bytes and size; `opened`: Pillow's look at it, when it had one."""
        width, height = size
        geometry = self.geometry(width, height)
        factor = geometry.reduction(width, height) if self.reduced_decode else 1
        decoded = None
        if factor == 1 and tensor_decodable and self.decoder.makes_tensors:
            decoded = self.decoder.decode_or_none(encoded)
        if decoded is None:  # reduced, not a JPEG, or what the decoder refused: Pillow's (the same libjpeg)
            draft = (width // factor, height // factor) if factor > 1 else None
            rgb = load_rgb(opened, encoded, path, draft) if opened is not None else decode_rgb(encoded, path, draft)
            decoded = uint8_tensor(rgb)
        image = geometry.apply(decoded, width, height)
        return self.augment(image) if self.augment is not None else image


# --data-backend gpu: the worker sends the file and its geometry, the device decodes.

@dataclasses.dataclass
class Encoded:
    """One image as a worker of the gpu backend hands it over: the JPEG's
    bytes and geometry, or (files nvJPEG should not get) the finished uint8 image."""

    data: Optional[torch.Tensor]  # the file's bytes, uint8
    geometry: Optional[Geometry]
    size: Tuple[int, int] = (0, 0)  # (width, height) of the file
    path: str = ""
    image: Optional[torch.Tensor] = None  # finished on the CPU
    decoder: Optional[JpegDecoder] = None  # the run's, for the JPEG
    augment: Optional[Callable] = None  # --auto-augment and --random-erase, run where the JPEG is decoded
    generator_state: Optional[torch.Tensor] = None  # torch's CPU generator after the geometry's draws, for `augment`


class EncodedImages(TensorImages):
    """--data-backend gpu: Loaded(Encoded, bytes read, ...). Only
    complete, upright RGB and grayscale JPEGs (an end marker) go to the GPU:
    a truncated file meets Pillow in the worker, where --bad-images decides
    about it, and CMYK, which nvJPEG does not convert, is finished in the
    worker; so is everything when the chosen decoder is Pillow's."""

    device_decodes_with_run_decoder = True  # the GPU decodes with the run's JpegDecoder (needs a tensor one)

    def from_bytes(self, encoded: bytes, path: str) -> Loaded:
        header = self.plain_header(encoded)
        cannot_decode = self.device_decodes_with_run_decoder and not self.decoder.makes_tensors
        if (header is None or cannot_decode or header.mode not in ("RGB", "L")
                or not encoded.rstrip(b"\0").endswith(JPEG_END)):
            finished, file_bytes, large = self.load(encoded, path)
            return Loaded(Encoded(None, None, image=finished), file_bytes, large)
        data = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        geometry = self.geometry(*header.size)
        state = torch.default_generator.get_state() if self.augment is not None else None  # drawn from on the device
        return Loaded(Encoded(data, geometry, header.size, path, decoder=self.decoder, augment=self.augment,
                              generator_state=state), len(encoded), 0)


def replayed(augment: Callable, image: torch.Tensor, generator_state: torch.Tensor) -> torch.Tensor:
    """`augment` (a gpu backend's Encoded's) on `image`, on its device,
    drawing what the worker would have drawn: torch's CPU generator set to
    the state the worker left after the crop and flip, then put back."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.set_state(generator_state)
        return augment(image)


class DaliImages(EncodedImages):
    """--data-backend dali: what the gpu backend's workers hand over, the
    same files as JPEGs whatever the run's decoder (DALI decodes them on the
    device: common.dali); the run's decoder finishes the others in the worker."""

    device_decodes_with_run_decoder = False

