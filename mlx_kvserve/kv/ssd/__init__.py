"""The SSD tier: KV blocks and tails persisted as verified files, one folder per namespace.

- format.py       the whole on-disk format: block and tail files, array names, checksum, durable writes
- folder_key.py   the folder's secret the checksums are keyed with (block.key)
- table_check.py  a block's array table against what the model's layout can hold
- writeback.py    early writeback of a written file (Linux), so its fsync finds the data on its way
- index.py        the index (hash -> entry in LRU order), index.json, reconciling it with the files
- store.py        SSDStore: its state, save path and disk budget; reads.py and upkeep.py its other halves
- tails.py        SSDTailStore: tails (partial last blocks) as files under their parent's folder
- writer.py       SSDWriterThread: saves off the MLX thread, in batches; write_queue.py its queue (by bytes),
                  write_jobs.py its jobs, the backlog it refills from (shed blocks RAM holds) and drain logs
- tier.py         SSDTier: what KVManager calls; routes writes to the writer, verifies reads
- folder_lock.py  FolderLock: one owner and any number of guest servers per folder
- budget.py       SSDBudget: one disk budget shared by several folders (the models of one server)
"""

from .folder_lock import FolderBusyError, FolderLock
from .format import BlockHeader, FormatError, atomic_write
from .index import folder_namespace
from .reads import LoadedBlock, PendingLoad
from .shutdown_record import SHUTDOWN_FILE, read_shutdown_record, write_shutdown_record
from .store import SaveResult, SSDStore, store_dir
from .tails import SSDTailStore
from .tier import SSDTier
from .writer import SSDWriterThread, WriteJob

__all__ = [
    "SHUTDOWN_FILE",
    "BlockHeader",
    "FolderBusyError",
    "FolderLock",
    "FormatError",
    "LoadedBlock",
    "PendingLoad",
    "SSDStore",
    "SSDTailStore",
    "SSDTier",
    "SSDWriterThread",
    "SaveResult",
    "WriteJob",
    "atomic_write",
    "folder_namespace",
    "read_shutdown_record",
    "store_dir",
    "write_shutdown_record",
]
