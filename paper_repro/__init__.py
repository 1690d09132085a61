"""Reproductions of the vAttention paper's experiments (Prabhu et al., ASPLOS 2025) with
this code: vattn's virtual KV cache against the in-tree paged baseline (vattn.paged).

    python -m paper_repro                 # every CPU experiment
    python -m paper_repro decode --quick  # one, at a tiny size

Each writes CSV, JSON (with the machine, versions and settings) and a PNG under
`paper_repro/results/<device>/`.
"""
