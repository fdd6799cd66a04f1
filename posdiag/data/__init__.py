"""Data shipped with posdiag: prose.txt, natural English prose written for the project, which `fit` scores a
trained model's likelihood on (about 1250 tokens through a 49k BPE vocabulary)."""
