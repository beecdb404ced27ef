"""What the tests share: tiny case files (`cases`), test doubles named as such (`doubles`, `fake_rank_runner`),
and checks the end-to-end tests make on real runs (`e2e`). Test modules import from here, never from each other."""
