"""The model as a graph: loading, the view the search reads, surgery, sizes, tensor matching."""
