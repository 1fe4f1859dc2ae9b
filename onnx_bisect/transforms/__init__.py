"""Model transforms named by a ``+NAME[=ARG]`` suffix on a backend spec, and the float64 upcast."""
