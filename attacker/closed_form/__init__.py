"""Closed-form attacks (one-shot solves of the captured gradient) and the analytic constraints they give."""
