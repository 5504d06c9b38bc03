"""The training loop around the step: TensorFlow's hooks and monitored sessions
(``hooks``), ``tf.distribute`` strategies (``distribute``), local worker clusters
(``cluster``).
"""
