"""Gyre: elastic online RL for xLong-horizon agents behind black-box harnesses.

See DESIGN.md (steering repo ``shared/``) for the architecture and vocabulary.
"""

__version__ = "0.1.0"
