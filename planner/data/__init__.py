"""What the training data looks like and how a step's samples are shared out.

`profile.py`: per-sample token counts summarized into a data profile (`planner
data-profile`); `packing.py`: a step's variable-length samples packed into each
pipeline's micro-batches so that every pipeline's work matches its speed;
`shards.py`: per-rank index files proportional to capacity that keep the class
balance (`planner partition`); `loading.py`: the cluster's data-loading and input
rates as a floor of the step (`solver.step.fed`).
"""
