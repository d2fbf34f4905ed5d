"""The owned path (`zero.path: owned`): each param, or layer of a stacked one, owned whole by one DP rank
(`plan.py`), reduce-scattered to its owner and gathered back after the step (`layout.py`)."""
