"""PNG plots (matplotlib, an optional dependency: pip install matplotlib). The CLI checks it is installed first."""

from __future__ import annotations


def write_rope_png(path: str, static: list, report) -> None:
    """Wavelength vs dim pair (before and after scaling, with L and N), and the `rope` check's
    applied-rotation error vs position when the model was probed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.check("rope").details.get("error_by_position", []) if report is not None else []
    panels = 1 + bool(rows)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    for r in static:
        tag = f" ({r.spec.layer_type})" if r.spec.layer_type else ""
        ax.semilogy(r.before.wavelengths, ".", alpha=0.5, label=f"before scaling{tag}")
        ax.semilogy(r.after.wavelengths, "-", label=f"after scaling{tag}")
    if static:
        ax.axhline(static[0].after.training_length, color="k", ls="-", lw=0.8,
                   label=f"L={static[0].after.training_length}")
        ax.axhline(static[0].after.target_length, color="r", ls="--", lw=0.8,
                   label=f"N={static[0].after.target_length}")
    ax.set_xlabel("dim pair")
    ax.set_ylabel("wavelength (tokens)")
    ax.legend(fontsize=7)
    if rows:
        ax = axes[0][1]
        for label in dict.fromkeys(r[0] for r in rows):
            pts = [(p, v) for lab, p, v in rows if lab == label]
            ax.plot([p for p, _ in pts], [max(v, 1e-3) for _, v in pts], "o-", label=label)
        ax.set_xscale("symlog", linthresh=1)  # position 0 at x=0, log spacing past 1
        ax.set_yscale("log")
        ax.set_xlim(left=0)
        ax.axhline(10, color="r", ls="--", lw=0.8, label="FAIL above")
        ax.set_xlabel("position")
        ax.set_ylabel("applied-rotation error / tolerance")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
