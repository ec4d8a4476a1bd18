"""A secondary tier in a local or shared folder: one verified file per block (docs/design.md, "Data
at rest").

Layout: ``<root>/<2 hex>/<2 hex>/<hex key>`` plus ``<root>/kvtier-fs.json``, the format marker.
The two shard folders are the key's *last* four hex digits (keys start with a version byte).
Folders are 0700 and files 0600: KV blocks are as private as the prompts they came from.
``_layout`` owns all of it, for the tier and for the ``kvtier`` command line.

What makes it trustworthy:

- **Never a torn or wrong block.** A block is written to a uniquely named temporary file beside
  its final place and renamed into place, so a reader sees the whole file or none. Every load
  checks the header (magic, version, key, length) and the payload's xxh3-64 before the bytes
  count as loaded; a bad file is removed, counted as ``corrupt`` and becomes a miss.
- **Survives kill -9 and restarts.** A process killed mid-store leaves at most a temporary file,
  which the next ``open()`` (or the walk after it) removes once its writer is gone. An owner
  keeps its catalog in the folder (a checkpoint and a log of the changes since, written in the
  background; ``_persistence``), so a new ``FSTier`` on the folder serves at once, in the LRU
  order the last one left (up to its last second of changes after a kill -9), checks keys the
  catalog lacks on the disk until a walk in the background has reconciled the catalog with
  the folder, and says which in ``FSTierStatistics``. Without a usable catalog (a shared
  folder's tier, a new folder, a damaged checkpoint) it rebuilds its index from the files,
  oldest first, before it opens.
- **Bounded.** With ``capacity_bytes`` the least recently used blocks are removed before a store
  would pass the limit. A store that finds the disk full (with or without a capacity) removes
  the least recently used blocks to make room and writes again, and says so in the log once
  per burst (``ENOSPC``: a cache on a full disk gives up its oldest blocks, not every new
  one); it fails as ``no_space`` only when the tier has nothing left to remove. A store that
  fails removes the shard folders it made, if nothing else was put in them meanwhile.
- **Shares a folder.** Several processes may use one folder: publishing is a rename, removal is
  an unlink, and a reader holding a file open keeps reading it even if another process evicts
  it, so the worst another process can do is turn a hit into a miss. Files are reached from
  the root without following links (one folder at a time, or in one ``openat2`` call that
  the kernel keeps beneath the root), so a shard folder replaced by a link cannot make the
  tier write, read or delete outside its root.
- **Never blocks the loop.** Each operation is one call in a worker thread (``anyio.to_thread``,
  bounded by ``max_concurrency`` for reads and ``max_write_concurrency`` for write-through);
  see ``_write`` and ``_read``. aiofiles would cost one thread hop per OS call
  (open, write, fsync, close, rename: five per store) and could be abandoned between them by a
  cancellation, leaving a temporary file behind; one hop per operation is faster and atomic.
  One exception: a ``load_many`` (what promotions call) of at most ``loop_read_bytes``
  (256 KiB by default) whose version 2 files the page cache holds is read on the event
  loop, through calls that fail rather than wait for the device (``_cached``): for such a
  batch the two thread hops cost the loop about as much as the copy, and the caller longer.
- **Deadlines hold on a hung mount.** A caller whose deadline fires leaves the thread behind
  (a syscall on a dead NFS server cannot be interrupted); reads land in a private buffer and
  writes copy the pool slot out first, so an abandoned thread never touches pool memory (see
  ``_calls``), unless the caller *lends* its buffers (``kvtier.common._lending``): the manager lends
  a host pool's reserved slots to a promotion, which then reads straight into them, and a
  read walked away from keeps its slot out of the pool, unpublished, until its thread
  returns. At most ``max_stuck_threads`` abandoned threads may still be running; past
  that, operations fail at once (``unavailable``) instead of piling threads onto the mount.
- **Batches cost a few thread hops.** ``load_many``/``store_many`` cut a batch into at most
  ``max_concurrency`` (``max_write_concurrency``) runs, each one worker-thread call that
  handles its blocks in turn, with ``load``'s and ``store``'s bookkeeping block by block
  (a bad block fails alone; capacity is kept in waves, so a block only evicts what is
  published). A *pinned* batch (the caller waits for it whatever happens, as the vLLM
  adapter does) reads into and writes from the caller's memory directly and is never
  walked away from; its deadline only stops blocks that have not started. Batches that
  are not pinned keep every deadline promise above. The batch machinery is its own job,
  so it lives in ``_batch``; ``FSTier`` checks a batch's arguments and hands it over.
- **O_DIRECT by default** (``direct_io=True``): blocks are written and read past the page
  cache where the file system takes O_DIRECT (probed at open; where it does not, the tier
  logs why and goes through the page cache). KV blocks are read back rarely and soon after
  they were evicted from the pool, so the page cache would only hold a second copy of what
  memory already held, and write-back would compete with the engine for the disk. A block
  file whose payload is a whole number of pages (64 KiB and up) is written in format 2: its
  header padded to one page, so the payload sits at an aligned offset and a *pinned* batch
  (or a lent one: a promotion) moves it straight between the disk and the caller's aligned
  memory, header page and payload in one request each way, the checksum verified over the
  bytes where they landed. Such a read goes through the page cache instead when the cache
  holds the whole file (``cachestat``; something else read it): a memcpy, where O_DIRECT
  would read the device again. Other blocks (and every call neither pinned nor lent, which
  must never let a thread it may walk away from touch the caller's memory) go through an
  aligned private buffer of the tier's. Smaller or
  odd-sized payloads keep the compact format 1, whose files older kvtiers wrote too; both
  read alike in either mode. Which buffer a block's bytes pass through, per block in a
  worker thread, is ``_blocks``'s.
- **A folder's owner answers without a stat.** Every process that uses a folder holds a
  shared lock on it, so each sees the others (``_ownership``). A tier alone on its folder is
  its only writer, so ``lookup()`` answers from the index at once: a key it holds is a
  ``HIT``, any other a ``MISS`` (``not_found``) (see ``_index``). A tier that shares its
  folder with other processes checks unknown keys on the disk in batches, because another
  process may have written them; so does an owner from the moment it finds another process
  on its folder (it checks every ``CHECK_SECONDS``, ``_keeper``). ``shared="auto"`` (the
  default) owns the folder while no other process uses it and shares it otherwise;
  ``shared=True`` always shares (a folder several engines write, on NFS for one);
  ``shared=False`` must own it and fails at open when another process uses it.
- **Keeps its folder.** The marker and the identity manifest are created exclusively, so of
  two tiers that open an empty folder at once the second reads the first one's marker and
  refuses it if they disagree (a signed and an unsigned tier never share a folder). A folder
  emptied while the tier runs (``rm -rf cache/*``) gets its marker, manifest and lock file
  back at the next check or the next store (which has to make a shard folder first), so it
  opens again; a folder that another tier's marker took meanwhile is not used any more. A
  tier that opens a folder whose marker is gone but which holds only kvtier's files waits
  (a few ``CHECK_SECONDS``) for the process using it to write the marker back; when nobody
  does, it writes marker and manifest itself, once the blocks it reads (a few, whole) were
  written with its settings, and refuses the folder otherwise.
- **A block being written is not a miss.** In either mode a key this tier is storing and
  does not hold yet answers ``RETRY``, and having answered so, its listeners hear the key
  when the store ends (landed or failed). A deferred write to a slower tier that copies
  the block from here then waits for it instead of giving the block up
  (``settled_lookup``). Stores and deletes of one key run one at a time, in this process:
  the later one's outcome is the folder's and the catalog's.
- **Tells routers what it holds** (``events``, ``kvtier.common._events``): a block is stored
  once its file is in place, and removed when it is evicted, found corrupt, deleted, or found
  gone, only ever for a key the tier held (see ``_ledger``). A file another process removes
  is found gone (``not_found``) by the next load of it, by the walk at (or after) the next
  open or an owner's walk while open (``walk_interval``), or, in a shared folder, by the
  next existence check of it. A shared folder's present verdicts do not expire (only the
  bounded verdict cache drops the oldest), so that check rarely comes first: the bound is
  the next load, which the manager makes only of a block it is about to use, so a stale HIT
  costs one failed read. An owner's bound is its walk while open (``_index``).
- **Signed blocks.** With ``integrity_key`` every block carries a keyed BLAKE3 MAC (blocks
  signed with keyed BLAKE2b before still verify) and only blocks that verify are served
  (anything else is a ``corrupt`` miss): someone who can write to a shared folder can no
  longer publish a block for a key. The folder marker names the key's public fingerprint, so
  a node without the key, or with another, refuses the folder at open rather than calling its
  peers' blocks corrupt. See ``kvtier.common._format``.

The ``fsync`` policy (what a store costs against what a crash of the *machine* can lose; a
crash of the process, kill -9 included, loses nothing that ``store`` returned under any policy,
because the page cache survives it):

- ``never``: fastest. After a power loss a recently stored block may be missing or, on some
  filesystems, present with zeroed or stale contents; the checksum catches that, so it is a
  miss (``corrupt``), never wrong bytes.
- ``data`` (default): ``fdatasync`` before the rename, so after a power loss a published block
  is whole; the newest blocks may be missing (their rename was not yet durable).
- ``always``: also ``fsync`` the folder after the rename, so a block is durable when ``store``
  returns. The slowest; for a cache it rarely pays.

How the package is built: ``FSTier`` (``_tier``) is an async shell that awaits the file work
around a synchronous core, the way httpcore's pool is a state machine with I/O outside it.

- ``_config``: ``FSConfig``, every setting of the tier (name, default, check) defined once.
- ``_tier``: ``FSTier``: open and close, lookup, load, store, delete, statistics.
- ``_catalog``: the bookkeeping as a state machine: index and LRU order, used and reserved
  bytes against the capacity, eviction victims, keys being stored, watcher epochs.
- ``_ledger``: books each outcome (catalog, counters, verdicts, notices) and maps ``OSError``
  to kvtier errors, once, for single blocks and batches alike.
- ``_batch``: ``load_many``/``store_many`` in a few thread hops.
- ``_blocks``: the worker threads, buffers and limits; whose memory a block passes through.
- ``_write`` (publish a block, remove one), ``_read`` (read one back and verify it) and
  ``_exists`` (a batch of existence checks): the blocking file work, one function per
  operation; ``_cached``: page-cached reads on the loop.
- ``_geometry``: where a block file's bytes sit (format version, header region) and the sizes
  of the aligned buffers that carry them.
- ``_layout``: names, shard folders, the marker, how files are opened (no links, O_DIRECT;
  ``_beneath``: the ``openat2`` call that stays beneath the root) and the descriptor-based
  walk; ``_root``: making a root, clearing dead writers' temporary files, listing its
  blocks, the O_DIRECT probe, and ``UnusableRootError``; ``_held``: the root's descriptor,
  held while the tier runs and looked at again when the folder may have been swapped.
- ``_calls``: worker calls a deadline can walk away from; ``_index``: the owner's lookups;
  ``_ownership``: the folder's locks, and who owns or shares the folder; ``_marker``: the
  marker and the identity manifest; ``_keeper``: the folder's own files from open to
  close; ``_upkeep``: the folder's checks on the event loop; ``_views``: the callers'
  buffers.
- The catalog across restarts (an owner's): ``_catalog_format`` (checkpoint and log as
  bytes), ``_catalog_files`` (reading them back, writing them atomically),
  ``_catalog_journal`` (noting changes, writing them in the background), ``_reconcile``
  (the walk that brings a loaded catalog in line with the folder, at open and every
  ``walk_interval`` while open, removing the shard folders churn left empty; ``_known``,
  the names it asks, held as key columns) and
  ``_persistence`` (the three at open and close, and ``FSTierStatistics``);
  ``_catalog_replay`` (the log replayed onto the checkpoint as columns).
- The catalog's index, packed (no Python object per block): ``_packed`` (``PackedOrder``,
  files by key in LRU order), ``_packed_table`` (its hash tables laid out at once),
  ``_packed_build`` (built from a checkpoint's names) and ``_idents`` (what it is keyed by).
"""

from __future__ import annotations

from kvtier.tiers.fs._config import FSYNC_POLICIES, FSConfig
from kvtier.tiers.fs._persistence import FSTierStatistics
from kvtier.tiers.fs._root import UnusableRootError
from kvtier.tiers.fs._tier import FSTier

__all__ = ["FSYNC_POLICIES", "FSConfig", "FSTier", "FSTierStatistics", "UnusableRootError"]
