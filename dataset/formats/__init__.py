"""formats: the bytes of one part file -> its records (WebDataset tar, TFRecord, lines; gzip).

The lowest stage above the shared types: nothing here fetches, samples or knows of an
index. :func:`read_part` picks the reader by the part's name (or ``record_format``);
each reader drops, counts and logs a damaged record and reads on. Thrift records
(:mod:`dataset.formats.thrift`) are decoded by processors, not here.
"""

from .damage import OutOfTime, ReadStats
from .gunzip import TooLarge
from .reader import FORMATS, part_format, read_part
from .tfrecord import masked_crc32c, write_tfrecord

__all__ = [
    "FORMATS",
    "OutOfTime",
    "ReadStats",
    "TooLarge",
    "masked_crc32c",
    "part_format",
    "read_part",
    "write_tfrecord",
]
