"""KV blocks handed from a prefill worker to a decode worker (disaggregated prefill and decode).

    broker --SUBMIT kv_send=D.kv_address--> prefill worker P      broker --SUBMIT kv_wait--> decode worker D
    P: computes the prompt (as a request of one output token), gathers the KV of its full prompt blocks
       (blocks.py) and sends them as one KV message (frames.py) over a DEALER to D's ROUTER (channel.py),
       then tells the broker PREFILLED.
    D: imports the blocks into its prefix cache under the hashes of P's token ids, then runs the job as any
       other: its own prompt hashes find the imported blocks (a prefix hit), so only the tail of the prompt
       (less than one block) is computed on D, and D samples and streams every token.

Lossless by construction: the blocks are content-addressed (a block is used only where D's own tokens hash
the same), and every failure falls back to computing the prompt on D: the broker's KV_LOST (P died, or P
could not send), a KV message that does not match D's cache geometry, or no KV within the wait bound.
The KV of one message never goes through the broker, and no pickle is on any wire (a msgpack header and
one raw payload frame). `roles.py` is the part the worker process's engine loop drives.

On CUDA the blocks are gathered on the device and staged through pinned host memory (one copy out on P,
one copy in on D), over the same ZeroMQ channel as on CPU.
"""
