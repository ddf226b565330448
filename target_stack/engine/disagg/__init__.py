"""Encode / prefill / decode disaggregation with a KV-transfer thread and Layer Split.

Three worker processes and a client::

    client --(image requests)--> encode --(embeddings)--+
    client --(text requests)------------------------------> prefill --(KV pages, state slots)--> decode --> client
                                                             main thread: prefill, layer by layer
                                                             transfer thread: ships finished stages

The prefill worker's layers are cut into ``stages`` (Layer Split).  When the mixer of a stage's
last layer is done for a sequence, the main thread submits a transfer of that stage's KV pages and
KDA state slots and goes on with the layer's MoE; the transfer thread writes them straight into the
pages and slot the decode worker reserved for the sequence (its pools are shared memory, or CUDA
IPC on a GPU).  The prefill's MoE runs through the native extension (the whole dispatch on the CPU,
the wait for the routing on a GPU); loaded so that it releases the GIL, the transfer thread runs
beside it, otherwise it waits for every call to end.  Events: ``prefill.start/done``,
``kv_transfer.submit/start/done``, ``dispatch.enter/exit`` (``target_stack.events``).

The decode worker adopts each transferred sequence into its own :class:`LLMEngine` and decodes it
with the others.

One idea a file: :mod:`.messages` (the wire protocol, typed), :mod:`.transfer` (the transfer thread
and its copy modes), :mod:`.workers` (the three processes), :mod:`.cluster` (the client).
"""

from target_stack.engine.disagg.cluster import DisaggCluster, DisaggResult
from target_stack.engine.disagg.messages import Timing
from target_stack.engine.disagg.transfer import COPY_MODES, PagePoster, TransferEngine, TransferItem
from target_stack.engine.disagg.workers import decode_worker, encode_worker, prefill_worker

__all__ = ["COPY_MODES", "DisaggCluster", "DisaggResult", "PagePoster", "Timing", "TransferEngine", "TransferItem",
           "decode_worker", "encode_worker", "prefill_worker"]
