"""`draftline plan`: time, storage, cost and memory of a run on each hardware profile, before
spending them (`build.build_plan` makes the plan; one module per concern)."""
