"""The built-in entropy-control methods, registered in a fixed order by importing their three families:
the baseline and the papers' methods (:mod:`~entropy_rft.control.paper_methods`), the classic ones
(:mod:`~entropy_rft.control.classic_methods`) and the field's methods
(:mod:`~entropy_rft.control.field_methods`, then STEER in :mod:`~entropy_rft.control.steer`, Entrocraft in
:mod:`~entropy_rft.control.entrocraft`, AEPO in :mod:`~entropy_rft.control.aepo` and Flexible Entropy Control in
:mod:`~entropy_rft.control.fec`). Every name stays importable from here.
"""

from entropy_rft.control.paper_methods import (
    PAPER_A,
    PAPER_B,
    ClipB,
    ClipBPaper,
    ClipCov,
    ClipV,
    ClipVPaper,
    KLCov,
    NoControl,
    tiny_cap_message,
    warn_tiny_cap,
)

from entropy_rft.control.classic_methods import (  # isort: skip  (registration order)
    DAPO,
    EIGHTY_TWENTY,
    ENTROPY_BONUS,
    ClipHigher,
    EntropyBonus,
    GradMask,
    HighEntropy,
)
from entropy_rft.control.field_methods import (  # isort: skip  (registration order)
    CE_GPPO,
    CHENG,
    CLIP_LOW,
    ENTROPIC,
    SKYWORK,
    CEGPPO,
    AdaptiveEntropy,
    ClipLow,
    EntropicControl,
    EntropyAdvantage,
    adaptive_entropy_measure,
    adaptive_entropy_step,
    entropic_step,
    entropy_advantage_shift,
)
from entropy_rft.control.steer import STEER, Steer, steer_entropy_change, steer_weights  # isort: skip
from entropy_rft.control.entrocraft import (  # isort: skip
    ENTROCRAFT,
    Entrocraft,
    entrocraft_band,
    entrocraft_mode,
    entrocraft_advantages,
)

from entropy_rft.control.aepo import AEPO, AEPOMethod, aepo_sample_num, aepo_splice, aepo_temperature  # isort: skip
from entropy_rft.control.fec import FEC, FlexibleEntropyControl, fec_bounds, fec_od_state, fec_width  # isort: skip

__all__ = [
    "PAPER_A", "PAPER_B", "DAPO", "EIGHTY_TWENTY", "ENTROPY_BONUS", "CHENG", "SKYWORK", "CE_GPPO", "CLIP_LOW",
    "ENTROPIC", "STEER", "ENTROCRAFT", "AEPO", "FEC",
    "NoControl", "ClipB", "ClipBPaper", "ClipV", "ClipVPaper", "ClipCov", "KLCov",
    "ClipHigher", "EntropyBonus", "HighEntropy", "GradMask",
    "EntropyAdvantage", "AdaptiveEntropy", "CEGPPO", "ClipLow", "EntropicControl", "Steer", "Entrocraft", "AEPOMethod",
    "FlexibleEntropyControl",
    "tiny_cap_message", "warn_tiny_cap", "entropy_advantage_shift", "adaptive_entropy_measure",
    "adaptive_entropy_step", "entropic_step", "steer_entropy_change", "steer_weights",
    "entrocraft_band", "entrocraft_mode", "entrocraft_advantages", "aepo_temperature", "aepo_sample_num",
    "aepo_splice", "fec_width", "fec_bounds", "fec_od_state",
]
