"""cel_utils: Capability Enhancement Localization toolkit."""
import os as _os

# OpenMP busy-waiting threads stall badly when cores are shared (measured up to 20x on 2 cores);
# this must be set before torch is first imported, so it lives at the package root.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
