"""Known verdicts per platform (``baselines/*.json``): what a record pins and how a night is judged against it
(``records``), the files on disk (``store``), and what changed from night to night (``trend``)."""
