"""entropy-rft: reinforcement fine-tuning with policy entropy at the centre.

Measure entropy dynamics (``dynamics``), control them (``control``, ``loss``), and train
and compare methods (``trainer``, ``cli``). See DESIGN.md for the path of the data.
"""

__version__ = "0.1.0"
