"""Node-local trajectory storage: HDF5 shard segments, the per-worker sample store, and (in
:mod:`reflow_hpc.storage.fetch`, which imports mpi4py) the cross-rank fetch of samples by id.

On-disk schema: docs/storage.md and :mod:`reflow_hpc.storage.schema`.
"""

from reflow_hpc.storage.reader import LostRows, ScanReport, SegmentScan, ShardReader, scan_directory
from reflow_hpc.storage.schema import (Location, LostSampleError, StorageError, UnknownSampleError,
                                       segment_name)
from reflow_hpc.storage.store import SampleStore
from reflow_hpc.storage.writer import ShardWriter

__all__ = ["Location", "LostRows", "LostSampleError", "SampleStore", "ScanReport", "SegmentScan",
           "ShardReader", "ShardWriter", "StorageError", "UnknownSampleError", "scan_directory",
           "segment_name"]
