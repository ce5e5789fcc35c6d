"""The CLI reference: every command of the ``llm-batch`` command tree and each of its
options. The tree is handed in (by ``llm-batch docs``, from its own root): this module
imports no command module, so the CLI and the reference import one way."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any

import typer
from typer.core import TyperArgument, TyperGroup, TyperOption

from llmbatch.reference.markdown import code, page, prose, symbolic, table

# Typer's shell-completion options on the root command are not llm-batch's.
_SKIPPED_PARAMS = frozenset({"install_completion", "show_completion"})


def render(root: TyperGroup) -> str:
    """The page of ``root``, the ``llm-batch`` command, and every command under it."""
    ctx = typer.Context(root, info_name="llm-batch")
    commands = list(_walk(ctx))
    summary = table(
        ["Command", "What it does"],
        [(_link(c), _first_line(c)) for c in commands],
    )
    return page(
        "CLI reference",
        f"{prose(root.help)} Every command is `llm-batch` followed by its group and name; "
        "`--help` on any of them prints the same text in the terminal.",
        [summary, *(_command(c) for c in commands if not isinstance(c.command, TyperGroup))],
    )


def _walk(ctx: typer.Context) -> Iterator[typer.Context]:
    """Depth first, in the order the app registers its commands."""
    group = ctx.command
    if not isinstance(group, TyperGroup):
        return
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        if sub is None or sub.hidden:
            continue
        sub_ctx = typer.Context(sub, info_name=name, parent=ctx)
        yield sub_ctx
        yield from _walk(sub_ctx)


def _anchor(ctx: typer.Context) -> str:
    return ctx.command_path.replace(" ", "-")


def _link(ctx: typer.Context) -> str:
    if isinstance(ctx.command, TyperGroup):
        return code(ctx.command_path)
    return f"[{code(ctx.command_path)}](#{_anchor(ctx)})"


def _first_line(ctx: typer.Context) -> str:
    text = prose(ctx.command.short_help or ctx.command.help)
    return text.split("\n\n", 1)[0]


def _command(ctx: typer.Context) -> str:
    command = ctx.command
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    # Markdown's own heading ids are the anchors _link points to ("llm-batch-dev-up").
    parts = [f"## {ctx.command_path}\n"]
    text = _help(command.help)
    if text:
        parts.append(text + "\n")
    parts.append(f"```\n{usage}\n```\n")
    params = [
        p
        for p in command.params
        if isinstance(p, TyperArgument | TyperOption)
        and not p.hidden
        and p.name not in _SKIPPED_PARAMS
    ]
    if params:
        rows = [_param(p, ctx) for p in params]
        parts.append(table(["Option", "Type", "Default", "Description"], rows))
    return "\n".join(parts)


def _help(text: str | None) -> str:
    # click's "\b" marks a paragraph it must not rewrap; Markdown has no use for it.
    return prose(text).replace("\b\n", "").replace("\b", "")


def _param(param: TyperArgument | TyperOption, ctx: typer.Context) -> tuple[str, str, str, str]:
    if isinstance(param, TyperArgument):
        name = code((param.metavar or param.name or "").upper())
        kind = _kind(param, ctx)
    else:
        name = code(" / ".join(", ".join(o) for o in (param.opts, param.secondary_opts) if o))
        kind = "flag" if param.is_flag else _kind(param, ctx)
    if param.multiple or param.nargs == -1:
        kind += ", repeatable"
    help_text = _help(param.help)
    if param.required:
        help_text = f"Required. {help_text}".strip()
    return name, kind, _default(param), help_text


def _default(param: TyperArgument | TyperOption) -> str:
    default = param.default
    if callable(default) or default is None or default == () or param.required:
        return ""
    if isinstance(param, TyperOption) and param.is_flag:
        if param.secondary_opts:
            return code((param.opts if default else param.secondary_opts)[0])
        return code(param.opts[0]) if default else ""
    if isinstance(default, list | tuple):
        return ", ".join(code(symbolic(str(_plain(d)))) for d in default)
    return code(symbolic(str(_plain(default))))


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _kind(param: TyperArgument | TyperOption, ctx: typer.Context) -> str:
    # Typer writes "<int>"; bare angle brackets would be read as HTML.
    return param.display_type(ctx).strip("<>").replace("|", " | ")
