"""A schema error as a sentence that says what is valid (config.validate's messages).

jsonschema's own messages name a sweepable key's failure as "'top-k' is not valid under any of the given schemas"
(a sweepable key is `oneOf` a value and a list of values) and a misspelt key as "Additional properties are not
allowed". Here every error on an enumerated key lists the valid values, a value of the wrong kind names the
expected type (and, in a sweep's list, which element), and an unknown key gets the nearest known key (difflib).
A number YAML 1.1 reads as a string (`3e-4`: PyYAML, so Snakemake too, wants `3.0e-4`) gets the form to write.
"""

import difflib
import re

import jsonschema
import yaml

_TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "null": "null", "object": "a mapping", "array": "a list"}  # fmt: skip
# A number with an exponent: YAML 1.1 reads it as one only with a dot in the mantissa and a sign in the exponent.
_EXPONENT_NUMBER = re.compile(r"([-+]?(?:\d+(?:\.\d*)?|\.\d+))[eE]([-+]?)(\d+)")
# "integer" as a config key means it: 1.0e+8 (a float) is no integer here, though JSON Schema would accept it.
_STRICT_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool)
)
_StrictValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_STRICT_TYPES)


def explain(err: jsonschema.ValidationError) -> tuple[str, str]:
    """(the key path, what is wrong and what is valid) of one error."""
    where = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties" and err.validator_value is False:
        return _unknown_keys(err, where)
    if err.validator == "enum":
        return where or "(top level)", _not_one_of(err.instance, err.validator_value)
    if err.validator in ("oneOf", "anyOf"):
        found = _no_branch_matches(err.instance, err.validator_value)
        if found is not None:
            return (where or "(top level)") + found[0], found[1]
        if isinstance(err.instance, dict) and err.schema.get("description"):  # a choice between sets of keys
            return where or "(top level)", f"this entry matches none of its forms: {err.schema['description']}"
    return where or "(top level)", err.message + _yaml11_number(err.instance, err.schema)


def _yaml11_number(value, schema: dict) -> str:
    """"; write 3.0e-4 (YAML 1.1 reads 3e-4 as a string)" when `value` is a number PyYAML read as a string and the
    schema takes the number it spells (as a float, else as an integer: `1e8` for an integer key is `100000000`)."""
    match = _EXPONENT_NUMBER.fullmatch(value) if isinstance(value, str) else None
    if match is None or not isinstance(yaml.safe_load(value), str):  # a quoted "1.5e-1": no YAML 1.1 surprise
        return ""
    mantissa, sign, exponent = match.groups()
    mantissa += "0" if mantissa.endswith(".") else "" if "." in mantissa else ".0"  # 3 -> 3.0, 1. -> 1.0
    written = [f"{mantissa}e{sign or '+'}{exponent}"]
    if float(value).is_integer():
        written.append(str(int(float(value))))
    check = _StrictValidator(schema).is_valid  # and each form checked as PyYAML reads it
    fit = next((text for text in written if check(yaml.safe_load(text))), None)
    return f"; write {fit} (YAML 1.1 reads {value} as a string)" if fit else ""


def describe(schema: dict) -> str | None:
    """What a schema accepts, in words ("an integer >= 1, or a non-empty list of them"); None when it is not a
    value's type (e.g. a choice between sets of required keys)."""
    if "enum" in schema:
        return "one of " + ", ".join(repr(v) for v in schema["enum"])
    if "const" in schema:
        return repr(schema["const"])
    branches = schema.get("oneOf") or schema.get("anyOf")
    if branches:
        words = [describe(b) for b in branches]
        if None in words:
            return None
        scalars = [w for b, w in zip(branches, words, strict=True) if b.get("type") != "array"]
        lists = [b for b in branches if b.get("type") == "array"]
        for b in lists:
            item = describe(b.get("items", {}))
            if item is None:
                return None
            plural = "them" if len(scalars) == 1 and item == scalars[-1] else f"({item})"
            scalars.append(f"a {'non-empty ' if b.get('minItems') else ''}list of {plural}")
        return _or_join(scalars)
    types = schema.get("type")
    if types is None:
        return None
    if types == "array" and "items" in schema:
        item = describe(schema["items"])
        return None if item is None else f"a {'non-empty ' if schema.get('minItems') else ''}list of ({item})"
    types = [types] if isinstance(types, str) else types
    bounds = _bounds(schema)
    return _or_join([_TYPE_NAMES.get(t, t) + (bounds if t in ("integer", "number") else "") for t in types])


def _bounds(schema: dict) -> str:
    low, high = (
        schema.get("minimum", schema.get("exclusiveMinimum")),
        schema.get("maximum", schema.get("exclusiveMaximum")),
    )
    opened, closed = "[" if "minimum" in schema else "(", "]" if "maximum" in schema else ")"
    if low is not None and high is not None:
        return f" in {opened}{low}, {high}{closed}"
    if low is not None:
        return f" {'>=' if 'minimum' in schema else '>'} {low}"
    return f" {'<=' if 'maximum' in schema else '<'} {high}" if high is not None else ""


def _or_join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + ", or " + words[-1]


def _nearest(word, known) -> str:
    """ "; did you mean 'x'?" for the closest known string, or nothing."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [k for k in known if isinstance(k, str)], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _not_one_of(value, allowed) -> str:
    return f"{value!r} is not one of {', '.join(repr(v) for v in allowed)}{_nearest(value, allowed)}"


def _no_branch_matches(value, branches: list[dict]) -> tuple[str, str] | None:
    """A sweepable key's failure: ("[i]" naming the bad element of a list, or "") and what is wrong and valid."""
    expected = describe({"oneOf": branches})
    if expected is None:
        return None
    lists = [b for b in branches if b.get("type") == "array" and "items" in b]
    if isinstance(value, list) and lists:
        if not value:
            return "", f"an empty list is not valid: expected {expected}"

        # the list branch the value follows longest (matryoshka takes a list of numbers or a list of such lists)
        def followed(found: tuple[int, dict]) -> tuple[int, bool]:  # then the branch whose element kind fits
            i, items = found
            return i, i < len(value) and isinstance(value[i], list) == (items.get("type") == "array")

        i, items = max(((_first_invalid(value, b["items"]), b["items"]) for b in lists), key=followed)
        if i < len(value):
            where, element = f"[{i}]", value[i]
            while (
                isinstance(element, list)
                and "items" in items
                and (j := _first_invalid(element, items["items"])) < len(element)
            ):
                where, element, items = f"{where}[{j}]", element[j], items["items"]
            hint = _nearest(element, items.get("enum", ())) or _yaml11_number(element, items)
            return where, f"{element!r} is not {describe(items)}{hint} (the key takes {expected})"
    known = [v for b in branches for v in b.get("enum", ())]
    hint = _nearest(value, known) or _yaml11_number(value, {"oneOf": branches})
    return "", f"{value!r} is not valid: expected {expected}{hint}"


def _first_invalid(values: list, items: dict) -> int:
    """The index of the first element the items schema refuses; len(values) when there is none."""
    check = jsonschema.Draft202012Validator(items).is_valid
    return next((i for i, v in enumerate(values) if not check(v)), len(values))


def _unknown_keys(err: jsonschema.ValidationError, where: str) -> tuple[str, str]:
    known = sorted(err.schema.get("properties", {}))
    extra = [k for k in err.instance if k not in known] if isinstance(err.instance, dict) else []
    if not extra:
        return where or "(top level)", err.message
    key = extra[0]
    hint = _nearest(key, known) or f"; the keys here are {', '.join(known)}"
    more = f" (and {', '.join(map(repr, extra[1:]))})" if len(extra) > 1 else ""
    return (f"{where}.{key}" if where else str(key)), f"unknown key {key!r}{more}{hint}"
