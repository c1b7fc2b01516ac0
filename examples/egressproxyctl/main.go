package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/imagecache"
	"github.com/egressproxy/egressproxy/kvm2"
)

// Exit codes, by error class (the root command's help lists them).
const (
	exitOK        = 0
	exitFailure   = 1 // an error without a class (a bug somewhere)
	exitUsage     = 2
	exitTransient = 3 // retry later (includes --timeout passing)
	exitPermanent = 4 // a human must act
	exitNotFound  = 5
	exitCanceled  = 130 // interrupted (Ctrl-C, SIGTERM): 128 + SIGINT
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop) // a second Ctrl-C kills at once
	code := run(ctx, os.Args[1:], &env{
		stdout: os.Stdout,
		stderr: os.Stderr,
		tty:    isTerminal(os.Stderr),
		open:   openKVM2,
		getenv: os.Getenv,
	})
	stop()
	os.Exit(code)
}

// env is what the program needs from its process; tests give their own.
type env struct {
	stdout, stderr io.Writer
	// tty: stderr is a terminal, so progress lines are shown.
	tty bool
	// open opens the clients of the selected config entries.
	open opener
	// getenv reads the environment (EGRESSPROXYCTL_CONFIG,
	// EGRESSPROXYCTL_PROXY_PASSWORD).
	getenv func(string) string
	// pollEvery is the pause between two reads of create --wait. Zero: 2s.
	pollEvery time.Duration
	// now is the clock of the AGE column. Nil: time.Now.
	now func() time.Time
	// buildInfo reads the program's build information (version). Nil:
	// debug.ReadBuildInfo.
	buildInfo func() (*debug.BuildInfo, bool)
}

// opener opens one client per config entry, in order. On error it closes
// what it opened. opts carries the logger and the image-fetch progress
// callback.
type opener func(ctx context.Context, cfgs []kvm2.Config, opts kvm2.Options) ([]*egressproxy.Client, error)

func openKVM2(ctx context.Context, cfgs []kvm2.Config, opts kvm2.Options) ([]*egressproxy.Client, error) {
	var out []*egressproxy.Client
	for _, c := range cfgs {
		o := opts
		p, err := kvm2.Open(ctx, c, &o)
		if err != nil {
			for _, q := range out {
				q.Close()
			}
			return nil, fmt.Errorf("entry %s: %w", c.Entry, err)
		}
		out = append(out, p)
	}
	return out, nil
}

// entry is one opened config entry.
type entry struct {
	cfg    kvm2.Config
	client *egressproxy.Client
}

func (e *entry) name() string { return e.cfg.Entry }

// usageError is bad input on the command line or in the config file.
// help: the command line is at fault, so the message is followed by a
// pointer to the command's --help.
type usageError struct {
	msg  string
	help bool
}

func (e *usageError) Error() string { return e.msg }

// usagef is bad input in the config file or a file a flag names.
func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// cmdLinef is a command line the program cannot take: wrong arguments,
// flags or flag values.
func cmdLinef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...), help: true}
}

// run is the whole program: it parses args, runs one command and returns
// the exit code. It writes only to e.stdout and e.stderr: the command's
// output on stdout, one error message on stderr.
func run(ctx context.Context, args []string, e *env) int {
	c := &cli{env: e}
	root := newRootCommand(c)
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	c.stopTimeout()
	code := exitCode(err)
	if ctx.Err() != nil && err != nil {
		code = exitCanceled // whatever the command made of it, we were interrupted
	}
	switch {
	case err == nil:
		return exitOK
	case code == exitCanceled:
		fmt.Fprintln(e.stderr, "egressproxyctl: canceled")
	default:
		fmt.Fprintln(e.stderr, "egressproxyctl: "+err.Error())
		var ue *usageError
		if errors.As(err, &ue) && ue.help && cmd != nil {
			fmt.Fprintf(e.stderr, "Run '%s --help' for usage.\n", cmd.CommandPath())
		}
	}
	return code
}

// globals are the flags every command takes.
type globals struct {
	config    string
	output    outputFormat
	noHeaders bool
	entry     string
	verbose   int
	timeout   time.Duration
}

// cli is one invocation: the environment, the global flags and the entries
// once opened.
type cli struct {
	*env
	g       globals
	entries []*entry
	// cancelTimeout ends the context of --timeout.
	cancelTimeout context.CancelFunc

	fetchMu sync.Mutex
	fetch   string // the latest image-fetch progress, for the progress line
}

func (c *cli) stopTimeout() {
	if c.cancelTimeout != nil {
		c.cancelTimeout()
	}
}

func (c *cli) clock() time.Time {
	if c.now != nil {
		return c.now()
	}
	return time.Now()
}

// onImageProgress records a cold image fetch's progress (kvm2's
// Options.ImageProgress); the progress line shows it.
func (c *cli) onImageProgress(p imagecache.Progress) {
	line := fmt.Sprintf("%s uploaded", mib(p.Bytes))
	if p.Total > 0 {
		line = fmt.Sprintf("%s of %s uploaded (%d%%)", mib(p.Bytes), mib(p.Total), p.Bytes*100/p.Total)
	}
	if p.Rate > 0 {
		line += fmt.Sprintf(", %.1f MB/s", p.Rate/1e6)
	}
	c.fetchMu.Lock()
	c.fetch = line
	c.fetchMu.Unlock()
}

func (c *cli) fetchProgress() string {
	c.fetchMu.Lock()
	defer c.fetchMu.Unlock()
	return c.fetch
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// configPath is --config, or $EGRESSPROXYCTL_CONFIG.
func (c *cli) configPath() string {
	if c.g.config != "" {
		return c.g.config
	}
	return c.getenv("EGRESSPROXYCTL_CONFIG")
}

// open loads the config and opens its selected entries. Close with
// closeAll.
func (c *cli) open(ctx context.Context) error {
	path := c.configPath()
	if path == "" {
		return usagef("no config file: give --config FILE or set EGRESSPROXYCTL_CONFIG")
	}
	cfg, err := loadConfig(path)
	if err != nil {
		return err
	}
	cfgs := cfg.Entries
	if c.g.entry != "" {
		cfgs = nil
		for _, ec := range cfg.Entries {
			if ec.Entry == c.g.entry {
				cfgs = append(cfgs, ec)
			}
		}
		if len(cfgs) == 0 {
			return cmdLinef("--entry %s: %s has no such entry (its entries: %s)", c.g.entry, path, strings.Join(entryNames(cfg.Entries), ", "))
		}
	}
	ps, err := c.env.open(ctx, cfgs, kvm2.Options{Logger: c.logger(), ImageProgress: c.onImageProgress, ImageProgressInterval: time.Second})
	if err != nil {
		var fe *egressproxy.FieldError
		if errors.As(err, &fe) {
			return usagef("%s: %v", path, err) // the config file is bad input
		}
		return err
	}
	for i, p := range ps {
		c.entries = append(c.entries, &entry{cfg: cfgs[i], client: p})
	}
	return nil
}

func entryNames(cfgs []kvm2.Config) []string {
	var out []string
	for _, c := range cfgs {
		out = append(out, c.Entry)
	}
	return out
}

// closeAll closes every opened entry (concurrently: each Close is bounded).
func (c *cli) closeAll() {
	var wg sync.WaitGroup
	for _, e := range c.entries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.client.Close()
		}()
	}
	wg.Wait()
}

// one returns the single selected entry, for commands that change one
// hypervisor.
func (c *cli) one(what string) (*entry, error) {
	if len(c.entries) != 1 {
		return nil, cmdLinef("%s acts on one entry and the config has %d; choose one with --entry (%s)", what, len(c.entries), strings.Join(c.names(), ", "))
	}
	return c.entries[0], nil
}

func (c *cli) names() []string {
	var out []string
	for _, e := range c.entries {
		out = append(out, e.name())
	}
	return out
}

// logger is the library's logger: stderr when --verbose is set, else
// discard.
func (c *cli) logger() logr.Logger {
	if c.g.verbose <= 0 {
		return logr.Discard()
	}
	var mu sync.Mutex
	w := c.stderr
	return funcr.New(func(prefix, args string) {
		mu.Lock()
		defer mu.Unlock()
		if prefix != "" {
			fmt.Fprintln(w, prefix, args)
		} else {
			fmt.Fprintln(w, args)
		}
	}, funcr.Options{Verbosity: c.g.verbose - 1})
}

// forEach runs fn for every selected entry concurrently and returns the
// errors in entry order (nil where fn succeeded).
func (c *cli) forEach(ctx context.Context, fn func(ctx context.Context, i int, e *entry) error) []error {
	errs := make([]error, len(c.entries))
	var wg sync.WaitGroup
	for i, e := range c.entries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(ctx, i, e)
		}()
	}
	wg.Wait()
	return errs
}

// exitCode maps an error to the exit code of its class.
func exitCode(err error) int {
	var ue *usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		return exitUsage
	}
	switch egressproxy.Code(err) {
	case egressproxy.Transient, egressproxy.DeadlineExceeded:
		return exitTransient
	case egressproxy.Permanent:
		return exitPermanent
	case egressproxy.NotFound:
		return exitNotFound
	case egressproxy.Canceled:
		return exitCanceled
	}
	return exitFailure
}

// severity orders exit codes for worst: higher is more severe.
var severity = map[int]int{exitOK: 0, exitNotFound: 1, exitTransient: 2, exitFailure: 3, exitPermanent: 4, exitUsage: 5, exitCanceled: 6}

// worst joins the errors of several entries; its exit code is that of the
// most severe of them (see exitCodesHelp).
func worst(errs []error) error {
	var out error
	var all []error
	for _, err := range errs {
		if err == nil {
			continue
		}
		all = append(all, err)
		if out == nil || severity[exitCode(err)] > severity[exitCode(out)] {
			out = err
		}
	}
	if len(all) <= 1 {
		return out
	}
	return &multiError{first: out, all: all}
}

// multiError is several entries' errors; it unwraps to the most severe, so
// exitCode and errors.As see that one, and prints them all.
type multiError struct {
	first error
	all   []error
}

func (m *multiError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d entries failed:", len(m.all))
	for _, err := range m.all {
		b.WriteString("\n  " + err.Error())
	}
	return b.String()
}

func (m *multiError) Unwrap() error { return m.first }

// entryErr prefixes an error with the entry it happened on, keeping its
// class.
func entryErr(e *entry, err error) error {
	if err == nil {
		return nil
	}
	if strings.Contains(err.Error(), "kvm2 "+e.name()+":") {
		return err // kvm2's errors name their entry already
	}
	return fmt.Errorf("entry %s: %w", e.name(), err)
}

// lookupErr is a failed List of e while a command looked name up: the
// entry's error, said as the command's step rather than as the client's
// "egressproxy list", with its class.
func lookupErr(e *entry, name string, err error) error {
	var op *egressproxy.OpError
	if errors.As(err, &op) {
		err = op.Err
	}
	return entryErr(e, fmt.Errorf("looking up %s: %w", name, err))
}

func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
