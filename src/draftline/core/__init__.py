"""What decides the outputs' tokens: the target (loading, prompt ids) and the loss mask."""
