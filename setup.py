"""distlearn: dataset loading, a ZeroMQ process tree and all-reduce SGD for PyTorch."""

import re
from pathlib import Path

from setuptools import Extension, find_packages, setup

# One import namespace, `distlearn`, while the repository keeps its top-level
# folders: dataset/ and ipc/ install as distlearn.dataset and distlearn.ipc.
# PyPI's `dataset` and `ipc` are other projects; we install no top-level
# module of those names. Editable installs follow the same mapping.
FOLDERS = {"distlearn": "distlearn", "distlearn.dataset": "dataset", "distlearn.ipc": "ipc"}
packages = [
    f"{name}.{sub}" if sub else name
    for name, folder in FOLDERS.items()
    for sub in ["", *find_packages(folder)]
]

# torch is not pinned here so users keep the build they have (CUDA, ROCm, CPU);
# scripts/venv.sh installs torch==2.13.0 first so this range resolves to it.
install_requires = [
    "torch>=2.1",
    "numpy>=1.24",
    "pillow>=9",
    "aiohttp>=3.9",
    "pyzmq>=25",
    "fsspec>=2023.6",
    "tqdm>=4.60",
    # CSV indexes split by its C++ reader (dataset/index/csv/arrow.py): required
    "pyarrow>=14",
]

DOCS = [
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings==1.0.8",
    "mkdocstrings-python==2.0.11",
]

extras = {
    "s3": ["s3fs>=2023.6"],
    "thrift": ["thrift>=0.16"],
    # TFRecord CRC32C in C; without it dataset.records falls back to pure Python (~1000x slower)
    "tfrecord": ["google-crc32c>=1.5"],
    # JPEGs decoded by libjpeg-turbo straight into numpy (dataset.processors.RandomResizedCrop,
    # Transform): about 2x Pillow's decode; without it, Pillow decodes them
    "jpeg": ["simplejpeg>=1.7"],
    "examples": ["matplotlib>=3.7"],
    # the docs site (mkdocs.yml): `mkdocs build --strict`, which tests/run.sh runs.
    # Pinned: a theme or handler release changes what --strict accepts.
    "docs": DOCS,
    # bench/thrift.py compares dataset.thrift with thrift's own (C-accelerated) decoder;
    # bench/index.py opening an index with pandas' and pyarrow's CSV readers
    "bench": [
        "matplotlib>=3.7",
        "requests>=2.28",
        "webdataset>=0.2.90",
        "thrift>=0.16",
        "pandas>=2.0",
        "pyarrow>=14",
        "simplejpeg>=1.7",
    ],
    "test": [
        "pytest>=7.4",
        "pytest-timeout>=2.1",
        "pytest-xdist>=3.2",
        "ruff>=0.5",
        "moto[server]>=5",
        "s3fs>=2023.6",
        "requests>=2.28",
        "webdataset>=0.2.90",
        "thrift>=0.16",
        "google-crc32c>=1.5",
        "pandas>=2.0",
        "pyarrow>=14",
        "simplejpeg>=1.7",
        "tensorboard>=2.14",  # the metrics exporter's test writes a real SummaryWriter
        *DOCS,
    ],
}
extras["all"] = sorted({req for reqs in extras.values() for req in reqs})

# Optional C: where it cannot be built (no C compiler), Python does the same work. Plain
# CSV/TSV indexes read in one pass (dataset/index/csv/lines.py; the other readers read every
# index), and Thrift records decoded (dataset/formats/thrift/_native.py; the pure-Python
# decoders give the same results).
extensions = [
    Extension("distlearn.dataset.index.csv._lines", ["dataset/index/csv/_lines.c"], optional=True),
    Extension(
        "distlearn.dataset.formats.thrift._fast", ["dataset/formats/thrift/_fast.c"], optional=True
    ),
]

setup(
    name="distlearn",
    version=re.search(
        r'__version__ = "([^"]+)"',
        Path(__file__).with_name("distlearn").joinpath("__init__.py").read_text(),
    )[1],
    description="Index-driven datasets, a ZeroMQ process tree and all-reduce SGD/EASGD for PyTorch",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir=FOLDERS,
    ext_modules=extensions,
    install_requires=install_requires,
    entry_points={"console_scripts": ["distlearn-serve = distlearn.dataset.serve:main"]},
    extras_require=extras,
    license="Apache-2.0",
)
