"""Simulation studies behind the default calibration recipe; not part of the oscar-gguf package.

Run them from the repository root, in the project's venv (they need the calibration extra):

    python -m research.config_study   --model MODEL.gguf --eval-text HELDOUT.txt --out DIR
    python -m research.rotation_study --model MODEL.gguf --eval-text HELDOUT.txt --out DIR

    config_study.py       rotation x clip ratios x window, and variants needing a runtime change
    rotation_study.py     which orthogonal rotation suits the oscar2 quantizer, learned ones included
    simulated_variants.py the variants (non-orthogonal K transform, refit encoder, per-head clips)
    study_setup.py        what the studies share: model, chunks, calibration, clip searches, table
"""
