# Which config the workflow runs (docs/workflow.md, "Config"): the files given with --configfile are the whole
# config; config/config.yaml (relative to the working directory) is read only when none is given, and a module
# declaration's `config:` replaces both. --config key=value overrides apply on top in every case.
# Every file is first read strictly (saeflow.config.read_yaml): a repeated key or a YAML syntax error stops the
# run with one line naming the file, before Snakemake's own, lenient reading is used.
# Roots (shards_root, runs_root, summary_dir): --config, else the last config file that sets one, else the config's
# `default_roots` (the OSC profile's), else the schema's default (saeflow.config.resolve_roots).
import sys

from saeflow import config as saeflow_config
from saeflow.errors import SaeflowError, one_line

DEFAULT_CONFIG_FPATH = "config/config.yaml"


def stop_workflow(err):
    """A user-caused problem found while planning: one line on stderr naming the file or key, exit status 1."""
    print(f"saeflow: {one_line(err)}", file=sys.stderr)
    sys.exit(1)


def config_fpaths():
    """The config files this invocation reads: the --configfile list, else the default (unless a module's
    `config:` stands in for both)."""
    if workflow.overwrite_configfiles:
        return [str(fpath) for fpath in workflow.overwrite_configfiles]
    if workflow.modifier.skip_configfile:
        return []
    return [DEFAULT_CONFIG_FPATH]


CONFIG_FILES = []  # (path, content) of every config file read, in order
for _fpath in config_fpaths():
    try:
        CONFIG_FILES.append((_fpath, saeflow_config.read_yaml(_fpath)))
    except SaeflowError as err:
        stop_workflow(err)

if not workflow.overwrite_configfiles:
    workflow.configfile(DEFAULT_CONFIG_FPATH)

# The user's roots win: a profile supplies only `default_roots`, used where no config file and no --config gives a
# root (before the schema's defaults fill in the rest). common.smk prints each root and where it came from.
ROOT_SOURCES = saeflow_config.resolve_roots(
    config, CONFIG_FILES, workflow.config_settings.config
)

# saeflow's own validation first: a typo is one line naming the file and the key (Snakemake's `validate`, next in
# the Snakefile, would print the whole schema); Snakemake's then fills the same defaults from the same schema.
try:
    saeflow_config.check(config, [fpath for fpath, _ in CONFIG_FILES])
except SaeflowError as err:
    stop_workflow(err)
