"""Localisation for ``golden.compare``: from what the paired submodules' inputs and outputs
say, in torch's execution order, where the Flax run first parts from the reference (inside a
submodule, in the code between two, after the last) and whose parameters are suspects.
"""

from __future__ import annotations


def _locate(steps, output_ok, grads_failing) -> dict:
    """Where the Flax run first parts from the reference, walking the paired submodules in
    torch's execution order: {"diagnosis": text or None, "interval": [A, B] or None, "owners":
    the pairs whose parameters are suspects}. A pair whose input already differs while the
    pair before it agreed puts the divergence in the code between them (A None: the module's
    inputs), where no mapped parameter is used, so that pair's own weights are not suspects;
    a pair whose input agrees and output does not puts it inside that pair; every pair agreeing
    and the output not puts it after the last one (B None: the module's output). A pair one
    side never called is stepped over: its output is compared nowhere, so the parameters of
    one the port does not call are suspects wherever the divergence shows after it."""
    def name(pair):
        return None if pair is None else " ~ ".join(pair)

    last, skipped, since = None, [], []  # the last pair that agreed; pairs the port does not
    for s in steps:                     # call before here, and since ``last``
        if s["missing"]:
            skipped += [s["pair"]] if s["missing"] == "Flax" else []
            since += [s["pair"]] if s["missing"] == "Flax" else []
            continue
        if s["output"] is False:
            b = name(s["pair"])
            if s["input"] is False:
                where = f"after `{name(last)}`, before `{b}`" if last else f"before `{b}`"
                text = (f"diverges {where}: in the code between "
                        f"{'them' if last else 'the module inputs and it'}"
                        f"{'' if since else ', where no mapped parameter is used'} (the input "
                        f"of `{b}` already differs, so its parameters are not suspects)")
                return _diagnosis(text, [name(last), b], skipped, since=since)
            if s["input"] is True:
                return _diagnosis(f"diverges inside `{b}`: its input agrees, its output "
                                  f"does not (its parameters or its code)", None, [],
                                  owners=[s["pair"]])
            text = (f"diverges by the output of `{b}`, whose input could not be compared (not a "
                    f"float array): inside it, or in the code before it"
                    + (f", after `{name(last)}`" if last else ""))
            return _diagnosis(text, None, skipped, owners=[s["pair"]])
        last, since = s["pair"], []  # its input may differ, its output agree (a norm's scale)
    if not output_ok:
        text = (f"diverges after `{name(last)}`, in the code that follows it: every paired "
                f"submodule agrees, the output does not" if last else
                "diverges in the module's own code: no paired submodule could be compared")
        return _diagnosis(text, [name(last), None], skipped, since=since)
    if grads_failing:
        text = (f"the output and every compared submodule agree, but {', '.join(grads_failing)} "
                f"do not: the backward pass differs (a stop_gradient, a custom VJP, a parameter "
                f"used outside the differentiated path)")
        return _diagnosis(text, None, skipped)
    return {"diagnosis": None, "interval": None, "owners": []}


def _diagnosis(text, interval, skipped, owners=(), since=()) -> dict:
    """The diagnosis with the pairs the port never called named (``since``: those torch runs
    inside the interval): their parameters are suspects, since the code that replaces their
    ``__call__`` is compared nowhere."""
    owners = list(owners)
    for t, f in skipped:
        text += (f"; the port does not call `{f}`'s `__call__` ({t} ~ {f}"
                 f"{', which torch runs there' if (t, f) in since else ''}), so what it does "
                 f"instead is compared nowhere and its parameters are suspects too")
        owners.append((t, f))
    return {"diagnosis": text, "interval": interval, "owners": owners}
