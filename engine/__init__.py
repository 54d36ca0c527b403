"""The LM engine. Importing it sets how this process's native thread pools wait between jobs,
which their libraries read once, as they load: so it comes before numpy or torch is imported
(`voice` imports it first too). A variable the user set is left as it is."""

import os

# numpy's OpenBLAS multiplies Whisper's and Smart Turn's mel filters (80 x 201 by 201 x 800) on two
# threads, and then its second thread spins on a core for a while after every call: 12% of the CPU
# that one talker's service used (perf, Zen 4), beside the LM's forward. One thread is as quick here.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# ggml's forward runs on libgomp (torch's copy, which loads first), whose threads spin 300,000 times
# before they sleep: a core held for milliseconds after each forward while speech recognition or
# synthesis waits for it. 10,000 still covers a barrier inside a forward; OMP_WAIT_POLICY=PASSIVE
# (no spin) makes every barrier a sleep and a 1-row step of the 1.5B 47 ms instead of 34-39.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
