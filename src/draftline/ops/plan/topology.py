"""Two nodes at once: one profile generates while another trains on the shards already pushed.

The pipeline's overlapped shape: each shard is validated and extracted on its own, and training
stage k trains the first epoch on shard k as soon as shard k is in; a last stage trains the
remaining epochs over every shard. With n = data.num_shards identical shards:

- per shard on the generating node G: g = generate_G / n (the plan's generation time, prefill
  and the schedule's utilisation included);
- per shard on the training node T: e = extract_T / n with offline features (the target forward
  on T), 0 with online ones (token packs only: a CPU tokenisation that the plan's online total
  leaves out too), and t1 = train_T / epochs / n, the first epoch over that shard, at the rate
  of the planned feature mode (online training pays the target forward in it);
- the chain is a two-machine flow shop of n identical jobs, each one machine's work done on
  the machine in turn: it ends at C = g + (e + t1) + (n - 1) x max(g, e + t1);
- then the remaining epochs over all shards on T: train_T x (epochs - 1) / epochs.

Overlapped wall time = C + remaining. Beside it: G alone, the plan's total for G (every stage
one after the other on one node), and G then T, sequential on two nodes: generate_G + extract_T
+ train_T. With n = 1 the overlapped and G-then-T wall times are equal.

Cost: G is rented only while it generates (n x g at its price_per_hour; given back once the last
shard is pushed). In the overlapped run T is held for the whole wall time: it is started beside
G, as the user starts both nodes, so the wait for the first shard counts as idle; in G then T it
is rented when generation ends, so it never idles. When g > e + t1 the trainer waits for each
shard; otherwise shards queue up and the generator is given back before the chain ends.

Left out, each small against a shard of this size: pushing and pulling a shard (MBs of
conversations; features never leave T), a training stage's start (loading the target and the
checkpoint, n times instead of once) and per-shard validation. The evaluate stage is left out of
every view, as the plan leaves it out of its totals.
"""

from __future__ import annotations

from typing import Any

from draftline.ops.plan.figures import DAY_S

# The sequential views beside the overlapped one, in the order the table shows them.
TOPOLOGIES = ("overlapped", "generate_node_alone", "generate_then_train")


def flow_shop_end(n: int, first: float, second: float) -> float:
    """When the last of n identical jobs leaves a two-machine flow shop (each job `first` seconds
    on machine 1, then `second` on machine 2; unbounded queue between them)."""
    return first + second + (n - 1) * max(first, second)


def _stage_s(profile: dict[str, Any], stage: str) -> float | None:
    return profile["stages"][stage]["seconds"]


def _needs(features: str) -> tuple[str, ...]:
    """The stages a training node runs in this feature mode."""
    return ("extract", "train_offline") if features == "offline" else ("train_online",)


def has_figures(profile: dict[str, Any], role: str, features: str) -> bool:
    """Whether the plan has every time the profile needs for a role ("generate" or "train")."""
    stages = ("generate",) if role == "generate" else _needs(features)
    return all(_stage_s(profile, s) is not None for s in stages)


def _view(
    wall: float, cost: float, gen_busy: float, train_busy: float | None, train_idle: float | None
) -> dict[str, Any]:
    return {
        "seconds": wall,
        "days": wall / DAY_S,
        "cost_usd": cost,
        "generate_busy_s": gen_busy,
        "train_busy_s": train_busy,
        "train_idle_s": train_idle,
    }


def two_nodes(plan: dict[str, Any], shards: int, generate_on: str, train_on: str) -> dict[str, Any]:
    """The overlapped run of one pair beside the two sequential ones (see the module docstring).

    `plan` is `build.build_plan`'s; both profiles must have their figures (`has_figures`).
    """
    features, epochs, n = plan["features"], int(plan["drafter"]["epochs"]), int(shards)
    gen_p, train_p = plan["profiles"][generate_on], plan["profiles"][train_on]
    generate = _stage_s(gen_p, "generate")
    extract = _stage_s(train_p, "extract") if features == "offline" else 0.0
    train = _stage_s(train_p, _needs(features)[-1])
    if generate is None or extract is None or train is None:
        raise ValueError(f"no figures for {generate_on} generating and {train_on} training")
    g, e, t1 = generate / n, extract / n, train / epochs / n
    chain = flow_shop_end(n, g, e + t1)
    remaining = train * (epochs - 1) / epochs
    wall = chain + remaining
    g_price, t_price = gen_p["price_per_hour"], train_p["price_per_hour"]
    train_busy = extract + train  # n x (e + t1) + remaining
    overlapped = _view(
        wall, (generate * g_price + wall * t_price) / 3600, generate, train_busy, wall - train_busy
    )
    overlapped |= {
        "train_idle_share": (wall - train_busy) / wall,
        "chain_s": chain,
        "remaining_train_s": remaining,
        "generator_early_s": chain - generate,  # when G is given back before the chain ends
    }
    alone = gen_p["total"][features]
    sequential = generate + extract + train
    return {
        "generate_on": generate_on,
        "train_on": train_on,
        "shards": n,
        "epochs": epochs,
        "features": features,
        "per_shard": {"generate_s": g, "extract_s": e, "train_first_epoch_s": t1},
        "bottleneck": "generate" if g > e + t1 else "train",
        "overlapped": overlapped,
        "generate_node_alone": _view(
            alone["seconds"], alone["cost_usd"], alone["seconds"], None, None
        ),
        "generate_then_train": _view(
            sequential,
            (generate * g_price + train_busy * t_price) / 3600,
            generate,
            train_busy,
            0.0,
        ),
    }


def _known(plan: dict[str, Any], profiles: dict[str, dict[str, Any]], role: str) -> list[str]:
    """GPU profiles with the figures for a role, in conf/hardware order."""
    return [
        name
        for name in profiles
        if profiles[name].get("gpu") and has_figures(plan["profiles"][name], role, plan["features"])
    ]


def choose_pairs(
    plan: dict[str, Any],
    profiles: dict[str, dict[str, Any]],
    generate_on: str | None = None,
    train_on: str | None = None,
) -> list[tuple[str, str]]:
    """(generating, training) profiles to show: the ones named, else by default the GPU profile
    that generates fastest, paired with each other GPU profile that can train (one table each);
    none when fewer than two GPU profiles have figures. A name not in conf/hardware, or a named
    profile without the figures for its role, stops with one line naming the choices."""
    features = plan["features"]
    for flag, name, role in (
        ("--generate-on", generate_on, "generate"),
        ("--train-on", train_on, "train"),
    ):
        if name is None:
            continue
        if name not in profiles:
            raise SystemExit(
                f"{flag} {name}: no such profile in conf/hardware/ (choose from "
                f"{', '.join(sorted(profiles))})"
            )
        if not has_figures(plan["profiles"][name], role, features):
            able = _known(plan, profiles, role)
            what = "generation" if role == "generate" else f"{features} training"
            raise SystemExit(
                f"{flag} {name}: no {what} figure for this target on {name} "
                "(measured on a run there, or throughput.* in conf/hardware/); profiles with one: "
                f"{', '.join(able) or 'none'}"
            )
    if generate_on and train_on:
        return [(generate_on, train_on)]
    generators, trainers = _known(plan, profiles, "generate"), _known(plan, profiles, "train")
    if train_on:
        others = [g for g in generators if g != train_on]
        pairs = [(_fastest(plan, others), train_on)] if others else []
    elif generate_on:
        pairs = [(generate_on, t) for t in trainers if t != generate_on]
    elif len(set(generators) | set(trainers)) < 2 or not generators:
        return []  # one node's plan: nothing to overlap
    else:
        fastest = _fastest(plan, generators)
        return [(fastest, t) for t in trainers if t != fastest]
    if not pairs:
        flag, name = ("--train-on", train_on) if train_on else ("--generate-on", generate_on)
        other = "--generate-on" if train_on else "--train-on"
        raise SystemExit(
            f"{flag} {name}: no other GPU profile has the figures for the other role; name one "
            f"with {other} (choose from {', '.join(sorted(profiles))})"
        )
    return pairs


def _fastest(plan: dict[str, Any], names: list[str]) -> str:
    return min(names, key=lambda n: plan["profiles"][n]["stages"]["generate"]["seconds"])


def add_two_nodes(
    plan: dict[str, Any],
    params: dict[str, Any],
    profiles: dict[str, dict[str, Any]],
    generate_on: str | None = None,
    train_on: str | None = None,
    pairs: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """The plan with `two_nodes`: one entry per pair `choose_pairs` picks (possibly none), or per
    pair of `pairs` the plan has figures for (the estimate-only plan beside a measured one, whose
    named profile may have figures only from its measurements)."""
    shards = int((params.get("data") or {}).get("num_shards") or 1)
    if pairs is None:
        pairs = choose_pairs(plan, profiles, generate_on, train_on)
    else:
        pairs = [
            (g, t)
            for g, t in pairs
            if has_figures(plan["profiles"][g], "generate", plan["features"])
            and has_figures(plan["profiles"][t], "train", plan["features"])
        ]
    plan["two_nodes"] = [two_nodes(plan, shards, g, t) for g, t in pairs]
    return plan
