"""Size defaults: every byte count hwsync picks when the caller does not, named and explained once."""

from __future__ import annotations

MiB = 1 << 20
GiB = 1 << 30

#: bucket size when neither the caller nor the transport says otherwise (both paths, and vLLM's trainer side):
#: 16-64 MiB measured best through shared memory here (larger spills the cache), and large enough to amortise a
#: collective's latency across nodes
DEFAULT_BUCKET_BYTES = 32 * MiB
#: buffers per sender (and per sender rank on a cross-node receiver): one packed while the other is loaded
DEFAULT_NUM_BUFFERS = 2
#: fewer buffers cannot overlap packing bucket k+1 with loading bucket k
MIN_NUM_BUFFERS = 2
