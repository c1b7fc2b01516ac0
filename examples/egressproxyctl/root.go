package main

import (
	"context"
	"errors"
	"io/fs"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/egressproxy/egressproxy/internal/errs"
)

const rootLong = `egressproxyctl manages egress proxies (Squid in small VMs) on the hypervisors
of a config file, one entry per hypervisor ("egressproxyctl help config").

Tables are for people; -o json, yaml or name print the same facts for
scripts. Notes, progress and errors go to stderr, never into the output.
Flags may come anywhere on the line. Ctrl-C cancels the call in flight.`

const exitCodesHelp = `Exit codes:
  0    success
  1    failure without an error class
  2    usage: bad flags, arguments or config file
  3    Transient: retry later (backend unreachable or busy, --timeout or
       --wait passed, proxy not answering, instance still provisioning)
  4    Permanent: a human must act (bad spec, refused credentials, image
       digest mismatch, image in use, not supported by the provider)
  5    NotFound: no such instance or image
  130  canceled: interrupted by Ctrl-C or SIGTERM
When several entries fail, the most severe class wins (canceled, usage,
Permanent, failure, Transient, NotFound).
`

const configLong = `The config file (--config FILE, or $EGRESSPROXYCTL_CONFIG) is JSON or YAML:
a list of entries, one per hypervisor, each in the form of the library's
kvm2 entry configuration, keys in camelCase, durations as strings ("30s"):

  entries:
    - entry: lab1                  # entry name (part of VM and volume names)
      owner: tooling               # ls, gc and delete see only this owner's proxies
      address: 192.0.2.10:22       # the hypervisor's sshd
      user: root
      keyFile: /home/me/.ssh/id_ed25519
      knownHostsFile: /home/me/.ssh/known_hosts   # or knownHosts: | and the lines
      pool: default
      images:
        debian-12:
          url: https://mirror.example/debian-12.qcow2
          sha256: <64 hex digits>
    - entry: lab2
      ...

An unknown key, a Go field name (CallTimeout) or a duration written as a
bare number is an error. Every problem of the file is reported at once,
each with its line and key path (exit code 2).`

// newRootCommand is the command tree of one invocation.
func newRootCommand(c *cli) *cobra.Command {
	root := &cobra.Command{
		Use:           "egressproxyctl",
		Short:         "Manage egress proxies on the hypervisors of a config file",
		Long:          rootLong,
		Args:          cobra.ArbitraryArgs,
		SilenceErrors: true,
		SilenceUsage:  true,
		// Without a command: the help, as kubectl and gh do.
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cmd.Help()
			}
			return unknownCommand(cmd, args[0])
		},
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			return c.setUp(cmd)
		},
	}
	root.SetOut(c.stdout)
	root.SetErr(c.stderr)
	root.SetFlagErrorFunc(flagError)
	root.SetUsageTemplate(root.UsageTemplate() + `{{if not .HasParent}}
` + exitCodesHelp + `{{end}}`)

	pf := root.PersistentFlags()
	c.g.output = outputTable
	pf.StringVar(&c.g.config, "config", "", "config file, JSON or YAML (default $EGRESSPROXYCTL_CONFIG)")
	pf.VarP(&c.g.output, "output", "o", "output format: table, json, yaml or name")
	pf.BoolVar(&c.g.noHeaders, "no-headers", false, "tables without their header line")
	pf.StringVar(&c.g.entry, "entry", "", "act on this config entry only (default: every entry)")
	pf.IntVarP(&c.g.verbose, "verbose", "v", 0, "library log lines on stderr: 1 its info lines, 2 and up its debug lines")
	pf.DurationVar(&c.g.timeout, "timeout", 0, "bound of the whole command, e.g. 5m (0: none)")
	_ = root.RegisterFlagCompletionFunc("output", cobra.FixedCompletions([]string{"table", "json", "yaml", "name"}, cobra.ShellCompDirectiveNoFileComp))
	_ = root.RegisterFlagCompletionFunc("entry", c.completeEntries)
	_ = root.MarkPersistentFlagFilename("config", "yaml", "yml", "json")

	root.AddCommand(
		newCheckCommand(c),
		newLsCommand(c),
		newCreateCommand(c),
		newDeleteCommand(c),
		newImagesCommand(c),
		newProbeCommand(c),
		newGCCommand(c),
		newVersionCommand(c),
		&cobra.Command{Use: "config", Short: "The config file: its form and an example", Long: configLong},
	)
	root.SetHelpCommand(newHelpCommand(root))
	root.InitDefaultCompletionCmd()
	for _, sub := range root.Commands() {
		if sub.Name() == "completion" {
			group(sub, "a shell: bash, zsh, fish or powershell")
		}
	}
	return root
}

// group makes cmd, a command with subcommands only, refuse to run without
// one (cobra would print its help and exit 0) and name an unknown one.
func group(cmd *cobra.Command, needs string) *cobra.Command {
	cmd.Args = cobra.ArbitraryArgs
	cmd.RunE = func(cmd *cobra.Command, a []string) error {
		if len(a) == 0 {
			return cmdLinef("%s needs %s", commandName(cmd), needs)
		}
		return unknownCommand(cmd, a[0])
	}
	return cmd
}

// setUp checks the global flags and starts --timeout's clock.
func (c *cli) setUp(cmd *cobra.Command) error {
	if c.g.verbose < 0 {
		return cmdLinef("--verbose %d: want 0 or more", c.g.verbose)
	}
	if c.g.timeout < 0 {
		return cmdLinef("--timeout %s: must not be negative", c.g.timeout)
	}
	if c.g.timeout > 0 {
		ctx, cancel := context.WithTimeout(cmd.Context(), c.g.timeout)
		c.cancelTimeout = cancel
		cmd.SetContext(ctx)
	}
	return nil
}

// newHelpCommand is "help [command]": the command's help on stdout; an
// unknown command is a usage error (cobra's own prints the root's usage
// and exits 0).
func newHelpCommand(root *cobra.Command) *cobra.Command {
	return &cobra.Command{
		Use:   "help [command]",
		Short: "Help about any command",
		Long:  "Help prints the help of any command: what it does, its flags and examples.",
		RunE: func(cmd *cobra.Command, args []string) error {
			target, rest, err := root.Find(args)
			if err != nil || len(rest) > 0 {
				return usagef("help: no command %s (egressproxyctl --help lists them)", errs.Quote(strings.Join(args, " ")))
			}
			target.InitDefaultHelpFlag() // as "COMMAND --help" shows it
			return target.Help()
		},
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
			parent, _, err := root.Find(args)
			if err != nil {
				return nil, cobra.ShellCompDirectiveNoFileComp
			}
			var out []cobra.Completion
			for _, sub := range parent.Commands() {
				if (sub.IsAvailableCommand() || sub.IsAdditionalHelpTopicCommand()) && strings.HasPrefix(sub.Name(), toComplete) {
					out = append(out, cobra.CompletionWithDesc(sub.Name(), sub.Short))
				}
			}
			return out, cobra.ShellCompDirectiveNoFileComp
		},
	}
}

// unknownCommand is the error of a command name the program does not
// know, with the closest names when there are some.
func unknownCommand(cmd *cobra.Command, name string) error {
	msg := "unknown command " + errs.Quote(name)
	if cmd.HasParent() {
		msg = commandName(cmd) + ": unknown subcommand " + errs.Quote(name)
	}
	if cmd.SuggestionsMinimumDistance <= 0 {
		cmd.SuggestionsMinimumDistance = 2
	}
	if s := cmd.SuggestionsFor(name); len(s) > 0 {
		msg += "; did you mean " + orList(s) + "?"
	}
	return cmdLinef("%s", msg)
}

// orList is "a", "a or b", "a, b or c".
func orList(s []string) string {
	if len(s) < 2 {
		return strings.Join(s, "")
	}
	return strings.Join(s[:len(s)-1], ", ") + " or " + s[len(s)-1]
}

// fileError is the error of a file named by flag that cannot be read.
func fileError(flag string, err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return usagef("%s %s: %v", flag, pe.Path, pe.Err)
	}
	return usagef("%s: %v", flag, err)
}

// flagError says what is wrong with a flag in plain words (pflag's own
// texts quote Go values and shorthand runes).
func flagError(cmd *cobra.Command, err error) error {
	var (
		invalid  *pflag.InvalidValueError
		required *pflag.ValueRequiredError
		missing  *pflag.NotExistError
	)
	switch {
	case errors.As(err, &invalid):
		f := invalid.GetFlag()
		return cmdLinef("%s %s: %s", flagName(f), errs.Quote(invalid.GetValue()), valueRule(f, invalid.Unwrap()))
	case errors.As(err, &required):
		return cmdLinef("%s needs a value", flagName(required.GetFlag()))
	case errors.As(err, &missing):
		short := missing.GetSpecifiedShortnames()
		if short == "" {
			return cmdLinef("unknown flag --%s", missing.GetSpecifiedName())
		}
		long, _, _ := strings.Cut(short, "=")
		if len(long) > 1 && cmd.Flags().Lookup(long) != nil {
			return cmdLinef("unknown flag -%s: long flags take two dashes (--%s)", long, long)
		}
		return cmdLinef("unknown flag -%s", long)
	}
	return cmdLinef("%s", err.Error())
}

// flagName is how the help names f: "-o/--output" or "--timeout".
func flagName(f *pflag.Flag) string {
	if f.Shorthand != "" {
		return "-" + f.Shorthand + "/--" + f.Name
	}
	return "--" + f.Name
}

// valueRule is what a value of f must be.
func valueRule(f *pflag.Flag, cause error) string {
	switch f.Value.Type() {
	case "duration":
		return "want a duration such as 30s, 5m or 1h30m"
	case "int":
		return "want a whole number"
	case "bool":
		return "want true or false"
	}
	if cause != nil {
		return cause.Error()
	}
	return "not a valid value"
}

// completeEntries completes --entry with the config file's entry names
// (the file is only read: nothing is dialled).
func (c *cli) completeEntries(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
	path := c.configPath()
	if path == "" {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	cfg, err := loadConfig(path)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	var out []cobra.Completion
	for _, e := range cfg.Entries {
		if strings.HasPrefix(e.Entry, toComplete) {
			out = append(out, e.Entry)
		}
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}

// completeImageKeys completes an image KEY with the keys the selected
// entries of the config file name.
func (c *cli) completeImageKeys(cmd *cobra.Command, args []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
	if len(args) > 0 {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	path := c.configPath()
	if path == "" {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	cfg, err := loadConfig(path)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	seen := map[string]bool{}
	var out []cobra.Completion
	for _, e := range cfg.Entries {
		if c.g.entry != "" && e.Entry != c.g.entry {
			continue
		}
		for k := range e.Images {
			if !seen[k] && strings.HasPrefix(k, toComplete) {
				seen[k] = true
				out = append(out, k)
			}
		}
	}
	slices.Sort(out)
	return out, cobra.ShellCompDirectiveNoFileComp
}

// The output formats of -o/--output.
const (
	outputTable outputFormat = "table"
	outputJSON  outputFormat = "json"
	outputYAML  outputFormat = "yaml"
	outputName  outputFormat = "name"
)

// outputFormat is the value of -o/--output.
type outputFormat string

func (o *outputFormat) String() string { return string(*o) }
func (o *outputFormat) Type() string   { return "format" }

func (o *outputFormat) Set(s string) error {
	switch f := outputFormat(s); f {
	case outputTable, outputJSON, outputYAML, outputName:
		*o = f
		return nil
	}
	return errors.New("want table, json, yaml or name")
}

// args is a positional-argument rule with plain messages: the command
// takes exactly the arguments named (none when what is empty).
func args(what ...string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, got []string) error {
		if len(got) == len(what) {
			return nil
		}
		name := commandName(cmd)
		switch {
		case len(what) == 0:
			return cmdLinef("%s takes no arguments; got %s", name, quoteAll(got))
		case len(got) < len(what):
			return cmdLinef("%s needs %s", name, strings.Join(what[len(got):], " and "))
		}
		return cmdLinef("%s takes %s; got %d arguments: %s", name, strings.Join(what, " and "), len(got), quoteAll(got))
	}
}

// commandName is the command as typed after the program's name
// ("images verify").
func commandName(cmd *cobra.Command) string {
	return strings.TrimPrefix(cmd.CommandPath(), cmd.Root().Name()+" ")
}

// quoteAll is the arguments, each quoted, separated by spaces.
func quoteAll(s []string) string {
	q := make([]string, len(s))
	for i, v := range s {
		q[i] = errs.Quote(v)
	}
	return strings.Join(q, " ")
}

// nonNegative refuses a negative value of the duration flag name.
func nonNegative(name string, d time.Duration) error {
	if d < 0 {
		return cmdLinef("--%s %s: must not be negative", name, d)
	}
	return nil
}
