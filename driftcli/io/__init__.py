"""Reading tensors (readers/), recording a step's matmul operands (capture), drift dumps, tables."""
