package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
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

// Exit codes, by error class (doc.go and -h list them).
const (
	exitOK        = 0
	exitFailure   = 1 // an error without a class (a bug somewhere)
	exitUsage     = 2
	exitTransient = 3 // retry later (includes -timeout passing)
	exitPermanent = 4 // a human must act
	exitNotFound  = 5
	exitCanceled  = 130 // interrupted (Ctrl-C, SIGTERM): 128 + SIGINT
)

const exitCodesHelp = `Exit codes:
  0    success
  1    failure without an error class
  2    usage: bad flags, arguments or config file
  3    Transient: retry later (backend unreachable or busy, -timeout passed,
       proxy not answering, instance still provisioning)
  4    Permanent: a human must act (bad spec, refused credentials, image
       digest mismatch, image in use, not supported by the provider)
  5    NotFound: no such instance or image
  130  canceled: interrupted by Ctrl-C or SIGTERM
When several entries fail, the most severe class wins (canceled, usage,
Permanent, failure, Transient, NotFound).
`

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
	// open opens the providers of the selected config entries.
	open opener
	// getenv reads the environment (EGRESSPROXYCTL_CONFIG,
	// EGRESSPROXYCTL_PROXY_PASSWORD).
	getenv func(string) string
	// pollEvery is create -wait's poll interval. Zero: 2s.
	pollEvery time.Duration
}

// opener opens one provider per config entry, in order. On error it closes
// what it opened.
// opts carries the logger and the image-fetch progress callback.
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
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// globals are the flags before the command.
type globals struct {
	config  string
	output  string
	entry   string
	verbose int
	timeout time.Duration
}

func (g *globals) json() bool { return g.output == "json" }

const usageText = `egressproxyctl — manage egress proxies on the hypervisors of a config file.

Usage:
  egressproxyctl [global flags] COMMAND [flags] [args]

Commands:
  check                          health of each entry, with the reason when unhealthy
  ls                             proxies of each entry: state, address, UID, age
  create -name N -uid U [flags]  create one proxy (idempotent on its UID)
  delete NAME [-uid U]           delete one proxy (by name, or by name and UID)
  images ls                      base images of each entry: key, digest, size, users
  images verify KEY              read a stored base back and check its digest
  images evict KEY               remove a stored base no proxy uses
  probe NAME -target HOST:PORT   a real HTTP CONNECT through the proxy NAME
  gc -owner O -keep-file F       delete the owner's proxies whose UID F does not list
                                 (-dry-run: only print them)

Run "egressproxyctl COMMAND -h" for the flags of a command.

Global flags:
`

// run is the whole program: it parses args, runs one command and returns
// the exit code. It writes only to e.stdout and e.stderr.
func run(ctx context.Context, args []string, e *env) int {
	err := runCommand(ctx, args, e)
	code := exitCode(err)
	if ctx.Err() != nil && err != nil {
		code = exitCanceled // whatever the command made of it, we were interrupted
	}
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return exitOK
	case code == exitCanceled:
		fmt.Fprintln(e.stderr, "egressproxyctl: canceled")
	default:
		fmt.Fprintln(e.stderr, "egressproxyctl:", err)
	}
	return code
}

func runCommand(ctx context.Context, args []string, e *env) error {
	var g globals
	fs := flag.NewFlagSet("egressproxyctl", flag.ContinueOnError)
	fs.SetOutput(e.stderr)
	fs.StringVar(&g.config, "config", "", "config file (JSON or YAML); default $EGRESSPROXYCTL_CONFIG")
	fs.StringVar(&g.output, "o", "table", "output: table (for people) or json (for scripts)")
	fs.StringVar(&g.entry, "entry", "", "act on this config entry only (default: every entry; required for create when there are several)")
	fs.IntVar(&g.verbose, "v", 0, "log verbosity on stderr: 0 none, 1 the library's info lines, 2 and up its V(1).. lines")
	fs.DurationVar(&g.timeout, "timeout", 0, "bound of the whole command, e.g. 5m (0: none; Ctrl-C always cancels)")
	fs.Usage = func() {
		fmt.Fprint(e.stderr, usageText)
		fs.PrintDefaults()
		fmt.Fprint(e.stderr, "\n"+configHelp+"\n"+exitCodesHelp)
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return &usageError{msg: err.Error()}
	}
	if g.output != "table" && g.output != "json" {
		return usagef("-o %q: want table or json", g.output)
	}
	if g.verbose < 0 {
		return usagef("-v %d: want 0 or more", g.verbose)
	}
	if g.timeout < 0 {
		return usagef("-timeout %s: must not be negative", g.timeout)
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return usagef("no command given")
	}
	cmd, rest := fs.Arg(0), fs.Args()[1:]
	c, ok := commands[cmd]
	if !ok {
		return usagef("unknown command %q (run egressproxyctl -h)", cmd)
	}
	if g.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, g.timeout)
		defer cancel()
	}
	return c(ctx, &cli{env: e, g: g}, rest)
}

// cli is one invocation: the environment, the global flags and the entries
// once opened.
type cli struct {
	*env
	g       globals
	entries []*entry

	fetchMu sync.Mutex
	fetch   string // the latest image-fetch progress, for the progress line
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

type command func(ctx context.Context, c *cli, args []string) error

var commands map[string]command

func init() {
	commands = map[string]command{
		"check":  cmdCheck,
		"ls":     cmdLs,
		"create": cmdCreate,
		"delete": cmdDelete,
		"images": cmdImages,
		"probe":  cmdProbe,
		"gc":     cmdGC,
	}
}

// newFlags returns the flag set of a command.
func (c *cli) newFlags(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(c.stderr)
	fs.Usage = func() {
		fmt.Fprintf(c.stderr, "Usage: egressproxyctl [global flags] %s\n", synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parse parses a command's flags, which may come before, between or after
// its positional arguments, and returns the positional arguments.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, &usageError{msg: fs.Name() + ": " + err.Error()}
		}
		if fs.NArg() == 0 {
			return pos, nil
		}
		pos = append(pos, fs.Arg(0))
		args = fs.Args()[1:]
	}
}

// open loads the config and opens its selected entries. Close with
// closeAll.
func (c *cli) open(ctx context.Context) error {
	path := c.g.config
	if path == "" {
		path = c.getenv("EGRESSPROXYCTL_CONFIG")
	}
	if path == "" {
		return usagef("no config file: give -config FILE or set EGRESSPROXYCTL_CONFIG")
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
			return usagef("-entry %q: no such entry in %s (entries: %s)", c.g.entry, path, strings.Join(entryNames(cfg.Entries), ", "))
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
func (c *cli) one(cmd string) (*entry, error) {
	if len(c.entries) != 1 {
		return nil, usagef("%s: the config has %d entries; choose one with -entry (%s)", cmd, len(c.entries), strings.Join(c.names(), ", "))
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

// logger is the library's logger: stderr when -v is set, else discard.
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
func (c *cli) forEach(ctx context.Context, fn func(ctx context.Context, e *entry) error) []error {
	errs := make([]error, len(c.entries))
	var wg sync.WaitGroup
	for i, e := range c.entries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = fn(ctx, e)
		}()
	}
	wg.Wait()
	return errs
}

// exitCode maps an error to the exit code of its class.
func exitCode(err error) int {
	var ue *usageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
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
