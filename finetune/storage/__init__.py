"""What a run keeps on disk and finds again: atomic folders (`atomic`), checkpoints and their resume checks
(`checkpoint`), the output directory and its lock (`outputs`), and fingerprints of weights and data
(`fingerprint`).

May import: `data`, `engine`, `config`, `errors`.
"""
