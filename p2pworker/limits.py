"""The hard size limits, in one place (invariant 8: none of them is reachable by a valid vLLM job).

A 1M-token prompt is 65,536 chunks of 16 tokens; the limits leave 16x room
above that.  Anything larger is refused with an error that names the limit,
through the job's normal failure path (the tier reports the job failed; it
never raises into vLLM's scheduler).

=====================  ==========  ==================================================
limit                  value       where it is enforced
=====================  ==========  ==================================================
MAX_JOB_KEYS           1,048,576   keys in one store/load job or one lookup: the tier
                                   fails a larger job at submit; the worker and the
                                   peer's session refuse it too
MAX_MSG_KEYS           8,192       keys in one control frame; a round of more keys
                                   goes as several frames (Fetch/Release/Lookup/
                                   LookupResp parts, Offers in pieces)
RING_MAX_MESSAGE_BYTES 256 MiB     one adapter<->worker ring message (it spans as many
                                   64 KiB slots as it needs; a 1M-key job of 32-byte
                                   keys is ~45 MB, of 128-byte keys ~145 MB)
MAX_KEY_BYTES          128         one key (vLLM's are 32-byte hashes)
MAX_FRAME_BYTES        4 MiB       one control frame (8,192 keys of 128 bytes fit)
=====================  ==========  ==================================================
"""

MAX_JOB_KEYS = 1 << 20
MAX_MSG_KEYS = 8192
RING_MAX_MESSAGE_BYTES = 256 << 20
MAX_KEY_BYTES = 128
MAX_FRAME_BYTES = 4 << 20
