"""On-policy distillation (``method=opd``): ``method`` is the method, ``teacher`` the hint judge and
teacher scoring (table ``opd_hints``), ``gate`` the teacher outcomes' way into the rollout buffer."""
