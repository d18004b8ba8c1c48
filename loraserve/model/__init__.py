"""Model families, weight loading and the architecture registry."""
