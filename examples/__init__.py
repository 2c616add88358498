"""Examples of using the audit with your own code (``--model examples.own_model:small_cnn``)."""
