"""The main job: placeholder until merak-core's Trainer lands (see issue 5).

It exits non-zero on purpose: the demo must never pretend to train.
"""

import sys

sys.exit("The 3D trainer (merak-core Trainer) is not built yet; nothing to demo.")
