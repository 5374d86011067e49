"""Layer 12: the HTML report: its page, figures (the probes' in probe_plots), HTML parts, and the pass-rate
histograms of erft eval and erft filter.
"""
