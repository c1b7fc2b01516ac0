package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/health"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// --- check ------------------------------------------------------------------

type checkRow struct {
	Entry     string            `json:"entry"`
	Reachable bool              `json:"reachable"`
	Reason    string            `json:"reason,omitempty"`
	Message   string            `json:"message,omitempty"`
	Details   map[string]string `json:"details,omitempty"`
	Capacity  *capacityRow      `json:"capacity,omitempty"`
	CheckedAt time.Time         `json:"checkedAt,omitzero"`
	Error     string            `json:"error,omitempty"`
}

// capacityRow is a Check's egressproxy.Capacity: absent when the Check
// could not learn it (always when the entry is not reachable).
type capacityRow struct {
	PoolAvailableBytes   int64 `json:"poolAvailableBytes"`
	MemoryAvailableBytes int64 `json:"memoryAvailableBytes"`
	CPUs                 int   `json:"cpus"`
	Instances            int   `json:"instances"`
}

// unhealthyErr is the error of an unhealthy entry: Transient when the
// reason may go away by itself (unreachable, unknown), Permanent when a
// human must act (credentials, host key, permissions, pool).
func unhealthyErr(h egressproxy.Health) error {
	code := egressproxy.Permanent
	switch h.Reason {
	case egressproxy.ReasonUnreachable, egressproxy.ReasonUnknown:
		code = egressproxy.Transient
	}
	return errs.Errorf(code, "unhealthy: %s: %s", h.Reason, h.Message)
}

func newCheckCommand(c *cli) *cobra.Command {
	return &cobra.Command{
		Use:   "check",
		Short: "Health of each entry, with the reason when unhealthy",
		Long: `Check connects to each entry's hypervisor and reports whether it is usable:
reachable, and otherwise why not (Unauthorized, HostKeyUnknown,
PoolNotActive, Unreachable, ...). The reason's explanation goes to stderr.
A reachable entry's capacity is shown too: the storage pool's free space,
the host's available memory and CPUs, and the proxies running there.
It exits 3 for an entry that is unreachable and 4 for one a human must fix
(credentials, host key, permissions, pool).`,
		Example: `  egressproxyctl check
  egressproxyctl check --entry lab1 -o json`,
		Args: args(),
		RunE: func(cmd *cobra.Command, _ []string) error { return c.check(cmd.Context()) },
	}
}

func (c *cli) check(ctx context.Context) error {
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	rows := make([]checkRow, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, i int, e *entry) error {
		rows[i].Entry = e.name()
		h, err := e.client.Check(ctx)
		if err != nil {
			rows[i].Error = err.Error()
			return entryErr(e, err)
		}
		rows[i].Reachable, rows[i].Reason, rows[i].Message, rows[i].Details, rows[i].CheckedAt = h.Reachable, string(h.Reason), h.Message, h.Details, h.CheckedAt
		if cp := h.Capacity; cp != nil {
			rows[i].Capacity = &capacityRow{PoolAvailableBytes: cp.PoolAvailableBytes, MemoryAvailableBytes: cp.MemoryAvailableBytes, CPUs: cp.CPUs, Instances: cp.Instances}
		}
		if !h.Reachable {
			return entryErr(e, unhealthyErr(h))
		}
		return nil
	})
	l := listing{doc: map[string]any{"entries": rows}, header: []string{"ENTRY", "REACHABLE", "REASON", "FREE", "MEMORY", "CPUS", "PROXIES", "DETAILS"}}
	for _, r := range rows {
		// What went wrong is said once, on stderr: the table names it.
		reach, details := "yes", formatDetails(r.Details)
		switch {
		case r.Error != "":
			reach, details = "unknown", ""
		case !r.Reachable:
			reach, details = "no", ""
		}
		var free, mem, cpus, proxies string
		if cp := r.Capacity; cp != nil {
			free, mem, cpus, proxies = size(cp.PoolAvailableBytes), size(cp.MemoryAvailableBytes), strconv.Itoa(cp.CPUs), strconv.Itoa(cp.Instances)
		}
		l.rows = append(l.rows, []string{r.Entry, reach, r.Reason, free, mem, cpus, proxies, details})
		l.names = append(l.names, r.Entry)
	}
	if err := c.print(l); err != nil {
		return err
	}
	return worst(problems)
}

func formatDetails(d map[string]string) string {
	keys := make([]string, 0, len(d))
	for k := range d {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, k+"="+d[k])
	}
	return strings.Join(parts, " ")
}

// --- ls ---------------------------------------------------------------------

type instanceRow struct {
	Entry         string    `json:"entry"`
	Name          string    `json:"name"`
	UID           string    `json:"uid"`
	State         string    `json:"state"`
	Address       string    `json:"address,omitempty"`
	AddressSource string    `json:"addressSource,omitempty"`
	CreatedAt     time.Time `json:"createdAt,omitzero"`
	SpecDigest    string    `json:"specDigest,omitempty"`
	Error         string    `json:"error,omitempty"` // reading the instance back failed
}

func rowOf(e *entry, inst egressproxy.Instance) instanceRow {
	return instanceRow{Entry: e.name(), Name: inst.Name, UID: inst.UID, State: string(inst.State), Address: inst.Address(),
		AddressSource: inst.AddressSource, CreatedAt: inst.CreatedAt, SpecDigest: inst.SpecDigest}
}

func (c *cli) printInstances(rows []instanceRow) error {
	if rows == nil {
		rows = []instanceRow{}
	}
	l := listing{doc: map[string]any{"instances": rows}, header: []string{"ENTRY", "NAME", "STATE", "ADDRESS", "UID", "AGE"}}
	now := c.clock()
	for _, r := range rows {
		addr := r.Address
		if r.Error != "" {
			addr = "?" // unknown: the read failed (said on stderr)
		}
		l.rows = append(l.rows, []string{r.Entry, r.Name, r.State, addr, r.UID, age(now, r.CreatedAt)})
		l.names = append(l.names, r.Entry+"/"+r.Name)
	}
	return c.print(l)
}

// listEntry lists an entry's instances and reads each back (List may leave
// addresses empty). An instance that is gone by then is left out; one
// whose read fails keeps List's facts and the error.
func listEntry(ctx context.Context, e *entry) ([]instanceRow, error) {
	insts, err := e.client.List(ctx)
	if err != nil {
		return nil, entryErr(e, err)
	}
	sort.Slice(insts, func(i, j int) bool { return insts[i].Name < insts[j].Name })
	var rows []instanceRow
	var problems []error
	for _, inst := range insts {
		got, err := e.client.Get(ctx, inst.Ref)
		switch {
		case err == nil:
			rows = append(rows, rowOf(e, got))
		case egressproxy.Code(err) == egressproxy.NotFound:
		default:
			r := rowOf(e, inst)
			r.Error = err.Error()
			rows = append(rows, r)
			problems = append(problems, entryErr(e, err))
		}
		if ctx.Err() != nil {
			break
		}
	}
	return rows, worst(problems)
}

func newLsCommand(c *cli) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "Proxies of each entry: state, address, UID, age",
		Long: `Ls lists the proxies of each selected entry that belong to the entry's owner,
each read back for its state and address.`,
		Example: `  egressproxyctl ls
  egressproxyctl ls -o name
  egressproxyctl ls --entry lab1 -o yaml`,
		Args: args(),
		RunE: func(cmd *cobra.Command, _ []string) error { return c.ls(cmd.Context()) },
	}
}

func (c *cli) ls(ctx context.Context) error {
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	perEntry := make([][]instanceRow, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, i int, e *entry) error {
		rows, err := listEntry(ctx, e)
		perEntry[i] = rows
		return err
	})
	var rows []instanceRow
	for _, r := range perEntry {
		rows = append(rows, r...)
	}
	if err := c.printInstances(rows); err != nil {
		return err
	}
	return worst(problems)
}

// instanceArg reads an instance argument, NAME or ENTRY/NAME (as -o name
// prints it): the entry part selects the entry as --entry does.
func (c *cli) instanceArg(arg string) (string, error) {
	name := arg
	if e, n, ok := strings.Cut(arg, "/"); ok {
		if c.g.entry != "" && c.g.entry != e {
			return "", cmdLinef("%s names entry %s, --entry names %s", errs.Quote(arg), e, c.g.entry)
		}
		c.g.entry, name = e, n
	}
	if err := naming.ValidateName("NAME", name); err != nil {
		return "", cmdLinef("%v", err)
	}
	return name, nil
}

// find looks an instance up by name on every selected entry. Exactly one
// entry must have it.
func (c *cli) find(ctx context.Context, name string) (*entry, egressproxy.Instance, error) {
	type hit struct {
		e    *entry
		inst egressproxy.Instance
	}
	hits := make([][]hit, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, i int, e *entry) error {
		insts, err := e.client.List(ctx)
		if err != nil {
			return lookupErr(e, name, err)
		}
		for _, inst := range insts {
			if inst.Name == name {
				hits[i] = append(hits[i], hit{e, inst})
			}
		}
		return nil
	})
	var all []hit
	for _, h := range hits {
		all = append(all, h...)
	}
	switch {
	case len(all) == 1:
		return all[0].e, all[0].inst, nil
	case len(all) > 1:
		var where []string
		for _, h := range all {
			where = append(where, h.e.name()+"/"+name)
		}
		return nil, egressproxy.Instance{}, usagef("instance %s is on several entries; name one: %s", name, strings.Join(where, ", "))
	}
	if err := worst(problems); err != nil {
		return nil, egressproxy.Instance{}, err // an entry we could not list may have it
	}
	return nil, egressproxy.Instance{}, errs.Errorf(egressproxy.NotFound, "no instance %s on %s (of the configured owners)", errs.Quote(name), strings.Join(c.names(), ", "))
}

// --- create -----------------------------------------------------------------

// createFlag names the flag of each Spec field, so that a bad spec is
// reported as the person wrote it.
var createFlag = map[string]string{"Name": "NAME", "UID": "--uid", "ImageKey": "--image", "MachineType": "--machine-type", "Port": "--port", "UserData": "--user-data-file"}

type createOptions struct {
	spec         egressproxy.Spec
	userDataFile string
	guest        guestOptions
	wait         time.Duration
}

func newCreateCommand(c *cli) *cobra.Command {
	var o createOptions
	cmd := &cobra.Command{
		Use:   "create NAME --uid UID",
		Short: "Create one proxy (idempotent on its UID)",
		Long: `Create creates one proxy on the selected entry (--entry, when the config has
several) and prints it. The same NAME and UID again is no error when the spec
is the same; another spec for them is (exit code 4).

When the image the proxy needs is not stored on the hypervisor yet, create
fetches it first and says so; on a terminal a progress line shows the bytes
uploaded. --wait waits, up to the duration given, until the proxy runs with
an address; when the duration passes first, the exit code is 3.

The proxy the guest runs is either described by flags (--proxy-user,
--allow-client, --allow-port, --allow-domain, --tls-cert-file, --open),
which render its user-data for images that follow the project's first-boot
contract, or given whole by --user-data-file. Described proxies are closed
by default: CONNECT to port 443 only unless --allow-port says more, and a
proxy needs --proxy-user or --allow-client unless --open says it serves
anyone who reaches its port. The password is read from
--proxy-password-file or $EGRESSPROXYCTL_PROXY_PASSWORD, never from the
command line, and only its hash reaches the guest.`,
		Example: `  egressproxyctl create proxy-a --uid 7f9c2d --entry lab1 --allow-client 10.0.0.0/8
  egressproxyctl create proxy-a --uid 7f9c2d --proxy-user team --proxy-password-file pw --allow-port 443 --allow-port 8443
  egressproxyctl create proxy-a --uid 7f9c2d --image debian-12 --port 8080 --wait 10m
  egressproxyctl create proxy-a --uid 7f9c2d --user-data-file squid.yaml -o json`,
		Args: args("one instance NAME"),
		RunE: func(cmd *cobra.Command, a []string) error {
			o.spec.Name = a[0]
			return c.create(cmd.Context(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.spec.UID, "uid", "", "the instance's identity; create is idempotent on it (required)")
	f.StringVar(&o.spec.ImageKey, "image", "", "image key of the entry (default: the entry's default image)")
	f.StringVar(&o.spec.MachineType, "machine-type", "", "machine type of the entry (default: the entry's default)")
	f.IntVar(&o.spec.Port, "port", 0, "proxy port in the instance (default 3128)")
	f.StringVar(&o.userDataFile, "user-data-file", "", "cloud-init user-data file given to the instance (instead of the proxy's description by flags)")
	o.guest.bind(f)
	f.DurationVar(&o.wait, "wait", 0, "wait up to this long until the instance runs with an address (0: do not wait)")
	_ = cmd.RegisterFlagCompletionFunc("image", c.completeImageKeys)
	return cmd
}

func (c *cli) create(ctx context.Context, o createOptions) error {
	spec := o.spec
	if err := nonNegative("wait", o.wait); err != nil {
		return err
	}
	if o.userDataFile != "" {
		b, err := os.ReadFile(o.userDataFile)
		if err != nil {
			return fileError("--user-data-file", err)
		}
		spec.UserData = string(b)
	}
	if o.guest.set() {
		if o.userDataFile != "" {
			return cmdLinef("--user-data-file and the proxy's description by flags (--proxy-user, --allow-client, ...) exclude each other")
		}
		ud, err := o.guest.userData(spec.Port, c.getenv("EGRESSPROXYCTL_PROXY_PASSWORD"))
		if err != nil {
			return err
		}
		spec.UserData = ud
	}
	if err := spec.Validate(); err != nil {
		return specError(err)
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	e, err := c.one("create")
	if err != nil {
		return err
	}

	label := fmt.Sprintf("creating %s on %s", spec.Name, e.name())
	if key, cold := coldImage(ctx, e, spec.ImageKey); cold {
		label = fmt.Sprintf("fetching image %s into %s (not cached yet) and creating %s", key, e.name(), spec.Name)
		c.note("%s: image %s is not cached on the host: this create fetches it first", e.name(), key)
	}
	set, stop := c.progress(label)
	inst, err := e.client.Create(ctx, spec)
	if err == nil && o.wait > 0 {
		set(fmt.Sprintf("waiting for %s on %s to run", spec.Name, e.name()))
		inst, err = c.waitRunning(ctx, e, spec.Ref(), o.wait)
	}
	stop()
	if err != nil {
		return entryErr(e, err)
	}
	return c.printInstances([]instanceRow{rowOf(e, inst)})
}

// waitRunning waits up to d for the instance to run with an address
// (Client.WaitRunning).
func (c *cli) waitRunning(ctx context.Context, e *entry, ref egressproxy.Ref, d time.Duration) (egressproxy.Instance, error) {
	wctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	every := c.pollEvery
	if every <= 0 {
		every = 2 * time.Second
	}
	inst, err := e.client.WaitRunning(wctx, ref, &egressproxy.WaitOptions{Interval: every})
	if err != nil && wctx.Err() != nil && ctx.Err() == nil {
		return inst, fmt.Errorf("--wait %s passed: %w", d, err)
	}
	return inst, err
}

// specError is a Spec's validation error, each field named as the command
// line gives it (--uid, not UID).
func specError(err error) error {
	fes := egressproxy.FieldErrors(err)
	if len(fes) == 0 {
		return cmdLinef("%v", err)
	}
	var msgs []string
	for _, fe := range fes {
		named := *fe
		if f, ok := createFlag[fe.Field]; ok {
			named.Field = f
		}
		msgs = append(msgs, named.Error())
	}
	return cmdLinef("%s", strings.Join(msgs, "; "))
}

// coldImage reports whether the image key a spec uses has no base on the
// entry yet (so Create fetches it first), when the provider can tell
// (driver.ImageManager). It never fails: this is only for the progress
// line.
func coldImage(ctx context.Context, e *entry, key string) (string, bool) {
	infos, err := e.client.ListImages(ctx)
	if err != nil {
		return "", false
	}
	if key == "" {
		key = e.cfg.DefaultImage
	}
	if key == "" && len(infos) == 1 {
		key = infos[0].Key
	}
	for _, info := range infos {
		if info.Key == key {
			return key, !info.Present
		}
	}
	return "", false
}

// --- delete -----------------------------------------------------------------

type deletedRow struct {
	Entry string `json:"entry"`
	Name  string `json:"name"`
	UID   string `json:"uid"`
}

func newDeleteCommand(c *cli) *cobra.Command {
	var uid string
	cmd := &cobra.Command{
		Use:   "delete NAME",
		Short: "Delete one proxy, found by name",
		Long: `Delete deletes one proxy and its volumes. NAME is looked up on every selected
entry and must be on exactly one (ENTRY/NAME, as -o name prints it, or
--entry selects the entry). With --uid nothing is looked up: the proxy of
that name and UID is deleted on the selected entry, and a missing one is
no error.`,
		Example: `  egressproxyctl delete proxy-a
  egressproxyctl delete lab1/proxy-a
  egressproxyctl delete proxy-a --entry lab1 --uid 7f9c2d
  egressproxyctl ls -o name | xargs -n1 egressproxyctl delete`,
		Args: args("one instance NAME"),
		RunE: func(cmd *cobra.Command, a []string) error { return c.delete(cmd.Context(), a[0], uid) },
	}
	cmd.Flags().StringVar(&uid, "uid", "", "the instance's UID (default: looked up by NAME)")
	return cmd
}

func (c *cli) delete(ctx context.Context, arg, uid string) error {
	name, err := c.instanceArg(arg)
	if err != nil {
		return err
	}
	ref := egressproxy.Ref{Name: name, UID: uid}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	var e *entry
	if uid == "" {
		var inst egressproxy.Instance
		if e, inst, err = c.find(ctx, ref.Name); err != nil {
			return err
		}
		ref.UID = inst.UID
	} else if e, err = c.one("delete --uid"); err != nil {
		return err
	}
	_, stop := c.progress(fmt.Sprintf("deleting %s on %s", ref.Name, e.name()))
	err = e.client.Delete(ctx, ref)
	stop()
	if err != nil {
		return entryErr(e, err)
	}
	row := deletedRow{Entry: e.name(), Name: ref.Name, UID: ref.UID}
	if c.g.output == outputTable {
		fmt.Fprintf(c.stdout, "deleted %s (uid %s) on %s\n", row.Name, row.UID, row.Entry)
		return nil
	}
	return c.print(listing{doc: map[string]any{"deleted": []deletedRow{row}}, names: []string{row.Entry + "/" + row.Name}})
}

// --- probe ------------------------------------------------------------------

type probeRow struct {
	Entry      string `json:"entry"`
	Name       string `json:"name"`
	Proxy      string `json:"proxy"`
	Target     string `json:"target"`
	OK         bool   `json:"ok"`
	StatusCode int    `json:"statusCode,omitempty"`
	Kind       string `json:"kind,omitempty"`
	LatencyMS  int64  `json:"latencyMs"`
	// EgressAddress is what --egress-url answered through the proxy.
	EgressAddress string `json:"egressAddress,omitempty"`
	EgressError   string `json:"egressError,omitempty"`
	Error         string `json:"error,omitempty"`
}

// probeErr classes a failed probe: a proxy that wants other credentials
// (407) needs a human; anything else (refused, timeout, proxy error,
// tunnel failed) may pass later.
func probeErr(res health.Result) error {
	switch res.Kind {
	case health.KindAuthRequired:
		return errs.WithCode(egressproxy.Permanent, res.Err)
	case health.KindCanceled:
		return errs.WithCode(egressproxy.Canceled, res.Err)
	}
	return errs.WithCode(egressproxy.Transient, res.Err)
}

// noAddressErr is the error of probing an instance without an address:
// Transient while it is Provisioning (it gets one as it boots; probe it
// later), Permanent in any other state (nothing changes until someone acts).
func noAddressErr(inst egressproxy.Instance) error {
	code := egressproxy.Permanent
	if inst.State == egressproxy.StateProvisioning {
		code = egressproxy.Transient
	}
	state := string(inst.State)
	if state == "" {
		state = "no state"
	}
	return errs.Errorf(code, "instance %s (%s) has no address to probe", errs.Quote(inst.Name), state)
}

type probeOptions struct {
	target, user, passFile, body string
	egressURL, caFile, tlsName   string
	timeout                      time.Duration
}

func newProbeCommand(c *cli) *cobra.Command {
	var o probeOptions
	cmd := &cobra.Command{
		Use:   "probe NAME --target HOST:PORT",
		Short: "A real HTTP CONNECT through one proxy",
		Long: `Probe sends an HTTP CONNECT for --target through the proxy NAME (or
ENTRY/NAME) and reports whether the tunnel opened. --expect-body also proves
the tunnel: a GET / through it must answer 200 with exactly that body (the
target must then be plain HTTP).

The proxy password is read from --proxy-password-file or
$EGRESSPROXYCTL_PROXY_PASSWORD, never from the command line, and never
printed. Probe exits 4 when the proxy demands other credentials (407) and 3
for any other failure.

--egress-url fetches a "what is my address" URL (any HTTP(S) endpoint that
answers with the caller's address) through the proxy and prints the address
the proxy's traffic leaves from (EGRESS). --proxy-ca-file speaks TLS to an
HTTPS proxy, trusting the CAs in the file.`,
		Example: `  egressproxyctl probe proxy-a --target example.com:443
  egressproxyctl probe lab1/proxy-a --target 10.0.0.5:80 --expect-body ok
  egressproxyctl probe proxy-a --target example.com:443 --proxy-user probe --proxy-password-file pw
  egressproxyctl probe proxy-a --target example.com:443 --egress-url https://ifconfig.me/ip --proxy-ca-file ca.pem`,
		Args: args("one instance NAME"),
		RunE: func(cmd *cobra.Command, a []string) error { return c.probe(cmd.Context(), a[0], o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.target, "target", "", "CONNECT target HOST:PORT, reachable from the proxy (required)")
	f.StringVar(&o.user, "proxy-user", "", "proxy basic-auth user (default: none)")
	f.StringVar(&o.passFile, "proxy-password-file", "", "file holding the proxy password (default: $EGRESSPROXYCTL_PROXY_PASSWORD)")
	f.StringVar(&o.body, "expect-body", "", "prove the tunnel: GET / through it must answer 200 with exactly this body")
	f.StringVar(&o.egressURL, "egress-url", "", `a "what is my address" URL fetched through the proxy: prints the proxy's egress address`)
	f.StringVar(&o.caFile, "proxy-ca-file", "", "PEM CA certificates: speak TLS to the proxy (an HTTPS proxy), trusting them")
	f.StringVar(&o.tlsName, "proxy-tls-name", "", "the name the proxy's certificate is verified for (default: its address)")
	f.DurationVar(&o.timeout, "probe-timeout", 10*time.Second, "bound of the probe")
	return cmd
}

func (c *cli) probe(ctx context.Context, arg string, o probeOptions) error {
	name, err := c.instanceArg(arg)
	if err != nil {
		return err
	}
	if o.target == "" {
		return cmdLinef("probe needs --target HOST:PORT")
	}
	if host, port, err := net.SplitHostPort(o.target); err != nil || host == "" || port == "" {
		return cmdLinef("--target %s: want HOST:PORT", errs.Quote(o.target))
	}
	if strings.Contains(o.user, ":") {
		return cmdLinef("--proxy-user must not contain ':' (HTTP basic authentication cannot carry it)")
	}
	if err := nonNegative("probe-timeout", o.timeout); err != nil {
		return err
	}
	opts, err := c.probeOptions(o)
	if err != nil {
		return err
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	e, found, err := c.find(ctx, name)
	if err != nil {
		return err
	}
	inst, err := e.client.Get(ctx, found.Ref)
	if err != nil {
		return entryErr(e, err)
	}
	if inst.IP == "" {
		return entryErr(e, noAddressErr(inst))
	}
	proxy := inst.Address()
	res := health.Probe(ctx, proxy, o.target, opts)
	row := probeRow{Entry: e.name(), Name: inst.Name, Proxy: proxy, Target: o.target, OK: res.OK,
		StatusCode: res.StatusCode, LatencyMS: res.Total.Milliseconds(), Error: errText(res.Err)}
	header := []string{"ENTRY", "NAME", "PROXY", "TARGET", "RESULT", "STATUS", "LATENCY"}
	egress := ""
	if o.egressURL != "" {
		header = append(header, "EGRESS")
		egress, row.EgressError = egressText(res)
		row.EgressAddress = egress
	}
	result := "ok"
	if !res.OK {
		row.Kind = res.Kind.String()
		result = "failed: " + row.Kind // the error itself goes to stderr
	}
	status := ""
	if row.StatusCode != 0 {
		status = strconv.Itoa(row.StatusCode)
	}
	if err := c.print(listing{
		doc:    row,
		header: header,
		rows:   [][]string{append([]string{row.Entry, row.Name, row.Proxy, row.Target, result, status, res.Total.Round(time.Millisecond).String()}, egressCell(o.egressURL, egress))[:len(header)]},
		names:  []string{row.Entry + "/" + row.Name},
	}); err != nil {
		return err
	}
	if !res.OK {
		return entryErr(e, probeErr(res))
	}
	return nil
}

// probeOptions are the probe's options from its flags: the password from
// --proxy-password-file or the environment (none without a user), TLS to
// the proxy, the egress URL and the tunnel proof.
func (c *cli) probeOptions(o probeOptions) (*health.ProbeOptions, error) {
	password := c.getenv("EGRESSPROXYCTL_PROXY_PASSWORD")
	if o.passFile != "" {
		b, err := os.ReadFile(o.passFile)
		if err != nil {
			return nil, fileError("--proxy-password-file", err)
		}
		password = strings.TrimRight(string(b), "\r\n")
	}
	if o.user == "" {
		password = "" // no user: no credentials at all
	}
	opts := &health.ProbeOptions{Timeout: o.timeout, Username: o.user, Password: password, EgressURL: o.egressURL}
	if o.caFile != "" {
		var err error
		if opts.ProxyTLS, err = proxyTLS(o.caFile, o.tlsName); err != nil {
			return nil, err
		}
	}
	if o.body != "" {
		opts.Exchange = health.HTTPGet(o.target, o.body)
	}
	return opts, nil
}

// --- gc ---------------------------------------------------------------------

type gcRow struct {
	Entry  string `json:"entry"`
	Name   string `json:"name"`
	UID    string `json:"uid"`
	Action string `json:"action"` // "deleted", "would delete", "failed"
	Error  string `json:"error,omitempty"`
}

// readKeepFile reads UIDs, one per line; blank lines and lines starting
// with '#' are ignored, surrounding spaces trimmed.
func readKeepFile(path string) (map[string]bool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	keep := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		keep[line] = true
	}
	return keep, sc.Err()
}

type gcOptions struct {
	owner, keepFile    string
	dryRun, allowEmpty bool
}

func newGCCommand(c *cli) *cobra.Command {
	var o gcOptions
	cmd := &cobra.Command{
		Use:   "gc --owner OWNER --keep-file FILE",
		Short: "Delete the owner's proxies that a keep file does not list",
		Long: `Gc deletes every proxy of the entries whose owner is OWNER and whose UID the
keep file does not list (one UID per line, '#' starts a comment). --dry-run
only prints what would be deleted. A keep file that lists no UID is refused
unless --allow-empty is given (it would delete every proxy of the owner).`,
		Example: `  egressproxyctl gc --owner tooling --keep-file wanted-uids --dry-run
  egressproxyctl gc --owner tooling --keep-file wanted-uids -o json`,
		Args: args(),
		RunE: func(cmd *cobra.Command, _ []string) error { return c.gc(cmd.Context(), o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.owner, "owner", "", "collect only on entries of this owner (required)")
	f.StringVar(&o.keepFile, "keep-file", "", "file listing the UIDs to keep, one per line (required)")
	f.BoolVar(&o.dryRun, "dry-run", false, "print what would be deleted, delete nothing")
	f.BoolVar(&o.allowEmpty, "allow-empty", false, "accept a keep file that lists no UID")
	return cmd
}

func (c *cli) gc(ctx context.Context, o gcOptions) error {
	var missing []string
	for _, f := range []struct{ name, value string }{{"--owner", o.owner}, {"--keep-file", o.keepFile}} {
		if f.value == "" {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return cmdLinef("gc needs %s", strings.Join(missing, " and "))
	}
	keep, err := readKeepFile(o.keepFile)
	if err != nil {
		return fileError("--keep-file", err)
	}
	if len(keep) == 0 && !o.allowEmpty {
		return usagef("%s lists no UID: that would delete every proxy of owner %s; give --allow-empty if that is meant", o.keepFile, o.owner)
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	var mine []*entry
	for _, e := range c.entries {
		if e.cfg.Owner == o.owner {
			mine = append(mine, e)
		} else {
			c.note("gc: skipping entry %s: its owner is %s, not %s", e.name(), e.cfg.Owner, o.owner)
		}
	}
	if len(mine) == 0 {
		return cmdLinef("gc: no selected entry has owner %s", errs.Quote(o.owner))
	}
	c.entries, mine = mine, c.entries // forEach runs over the owner's entries; closeAll still closes all
	defer func() { c.entries = mine }()

	rows, nkept, problems := c.collect(ctx, keep, o.dryRun)
	l := listing{doc: map[string]any{"dryRun": o.dryRun, "instances": rows, "kept": nkept}, header: []string{"ENTRY", "NAME", "UID", "ACTION"}}
	failed := 0
	for _, r := range rows {
		l.rows = append(l.rows, []string{r.Entry, r.Name, r.UID, r.Action}) // a failure's error goes to stderr
		l.names = append(l.names, r.Entry+"/"+r.Name)
		if r.Action == "failed" {
			failed++
		}
	}
	if err := c.print(l); err != nil {
		return err
	}
	if o.dryRun {
		c.note("gc: %d kept, %d would be deleted (dry run)", nkept, len(rows))
	} else {
		c.note("gc: %d kept, %d deleted, %d failed", nkept, len(rows)-failed, failed)
	}
	return problems
}

// collect deletes (or with dryRun only lists) the proxies of the selected
// entries whose UID keep lacks, and returns what it did, how many it kept
// and the failures.
func (c *cli) collect(ctx context.Context, keep map[string]bool, dryRun bool) ([]gcRow, int, error) {
	perEntry := make([][]gcRow, len(c.entries))
	kept := make([]int, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, i int, e *entry) error {
		insts, err := e.client.List(ctx)
		if err != nil {
			return entryErr(e, err)
		}
		sort.Slice(insts, func(i, j int) bool { return insts[i].Name < insts[j].Name })
		var problems []error
		for _, inst := range insts {
			if keep[inst.UID] {
				kept[i]++
				continue
			}
			r := gcRow{Entry: e.name(), Name: inst.Name, UID: inst.UID, Action: "would delete"}
			if !dryRun {
				r.Action = "deleted"
				if err := e.client.Delete(ctx, inst.Ref); err != nil {
					r.Action, r.Error = "failed", err.Error()
					problems = append(problems, entryErr(e, err))
				}
			}
			perEntry[i] = append(perEntry[i], r)
			if ctx.Err() != nil {
				break
			}
		}
		return worst(problems)
	})
	rows := []gcRow{}
	nkept := 0
	for i := range perEntry {
		rows = append(rows, perEntry[i]...)
		nkept += kept[i]
	}
	return rows, nkept, worst(problems)
}
