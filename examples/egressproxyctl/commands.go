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
	CheckedAt time.Time         `json:"checkedAt,omitzero"`
	Error     string            `json:"error,omitempty"`
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

func cmdCheck(ctx context.Context, c *cli, args []string) error {
	fs := c.newFlags("check", "check")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("check: no arguments expected, got %q", pos)
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	rows := make([]checkRow, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, e *entry) error {
		i := indexOf(c.entries, e)
		rows[i].Entry = e.name()
		h, err := e.client.Check(ctx)
		if err != nil {
			rows[i].Error = err.Error()
			return entryErr(e, err)
		}
		rows[i].Reachable, rows[i].Reason, rows[i].Message, rows[i].Details, rows[i].CheckedAt = h.Reachable, string(h.Reason), h.Message, h.Details, h.CheckedAt
		if !h.Reachable {
			return entryErr(e, unhealthyErr(h))
		}
		return nil
	})
	if c.g.json() {
		if err := c.printJSON(map[string]any{"entries": rows}); err != nil {
			return err
		}
	} else {
		var table [][]string
		for _, r := range rows {
			reach := "yes"
			if !r.Reachable {
				reach = "no"
			}
			detail := r.Message
			if r.Error != "" {
				reach, detail = "error", r.Error
			} else if r.Reachable {
				detail = formatDetails(r.Details)
			}
			table = append(table, []string{r.Entry, reach, r.Reason, detail})
		}
		c.printTable([]string{"ENTRY", "REACHABLE", "REASON", "DETAILS"}, table)
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

func indexOf(es []*entry, e *entry) int {
	for i, x := range es {
		if x == e {
			return i
		}
	}
	panic("entry not found")
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
	if c.g.json() {
		if rows == nil {
			rows = []instanceRow{}
		}
		return c.printJSON(map[string]any{"instances": rows})
	}
	var table [][]string
	for _, r := range rows {
		addr := r.Address
		if r.Error != "" {
			addr = "? (" + r.Error + ")"
		}
		table = append(table, []string{r.Entry, r.Name, r.State, addr, r.UID, age(r.CreatedAt)})
	}
	c.printTable([]string{"ENTRY", "NAME", "STATE", "ADDRESS", "UID", "AGE"}, table)
	return nil
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

func cmdLs(ctx context.Context, c *cli, args []string) error {
	fs := c.newFlags("ls", "ls")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("ls: no arguments expected, got %q", pos)
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	perEntry := make([][]instanceRow, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, e *entry) error {
		rows, err := listEntry(ctx, e)
		perEntry[indexOf(c.entries, e)] = rows
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

// find looks an instance up by name on every selected entry. Exactly one
// entry must have it.
func (c *cli) find(ctx context.Context, name string) (*entry, egressproxy.Instance, error) {
	type hit struct {
		e    *entry
		inst egressproxy.Instance
	}
	hits := make([][]hit, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, e *entry) error {
		insts, err := e.client.List(ctx)
		if err != nil {
			return lookupErr(e, name, err)
		}
		for _, inst := range insts {
			if inst.Name == name {
				hits[indexOf(c.entries, e)] = append(hits[indexOf(c.entries, e)], hit{e, inst})
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
			where = append(where, h.e.name())
		}
		return nil, egressproxy.Instance{}, usagef("instance %q is on several entries (%s); choose one with -entry", name, strings.Join(where, ", "))
	}
	if err := worst(problems); err != nil {
		return nil, egressproxy.Instance{}, err // an entry we could not list may have it
	}
	return nil, egressproxy.Instance{}, errs.Errorf(egressproxy.NotFound, "no instance %s on %s (of the configured owners)", errs.Quote(name), strings.Join(c.names(), ", "))
}

// --- create -----------------------------------------------------------------

func cmdCreate(ctx context.Context, c *cli, args []string) error {
	fs := c.newFlags("create", "create -name NAME -uid UID [-image KEY] [-machine-type TYPE] [-port PORT] [-user-data-file FILE] [-wait DURATION]")
	var spec egressproxy.Spec
	var userDataFile string
	var wait time.Duration
	fs.StringVar(&spec.Name, "name", "", "instance name: lowercase DNS label (required; also accepted as the argument)")
	fs.StringVar(&spec.UID, "uid", "", "instance identity; create is idempotent on it (required)")
	fs.StringVar(&spec.ImageKey, "image", "", "image key of the entry's images (default: the entry's default image)")
	fs.StringVar(&spec.MachineType, "machine-type", "", "machine type of the entry (default: the entry's default)")
	fs.IntVar(&spec.Port, "port", 0, "proxy port in the instance (0: 3128)")
	fs.StringVar(&userDataFile, "user-data-file", "", "cloud-init user-data file given to the instance")
	fs.DurationVar(&wait, "wait", 0, "wait up to this long for the instance to run with an address (0: return once created)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	switch {
	case len(pos) == 1 && spec.Name == "":
		spec.Name = pos[0]
	case len(pos) > 0:
		return usagef("create: unexpected arguments %q", pos)
	}
	if wait < 0 {
		return usagef("create: -wait %s must not be negative", wait)
	}
	if userDataFile != "" {
		b, err := os.ReadFile(userDataFile)
		if err != nil {
			return usagef("create: -user-data-file: %v", err)
		}
		spec.UserData = string(b)
	}
	if err := spec.Validate(); err != nil {
		return usagef("create: %v", err)
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
	if err == nil && wait > 0 {
		set(fmt.Sprintf("waiting for %s on %s to run", spec.Name, e.name()))
		inst, err = c.waitRunning(ctx, e, inst, wait)
	}
	stop()
	if err != nil {
		return entryErr(e, err)
	}
	return c.printInstances([]instanceRow{rowOf(e, inst)})
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

// waitRunning polls the instance until it runs with an address, for at
// most d. Transient read errors while it boots are expected and retried.
func (c *cli) waitRunning(ctx context.Context, e *entry, inst egressproxy.Instance, d time.Duration) (egressproxy.Instance, error) {
	wctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	every := c.pollEvery
	if every <= 0 {
		every = 2 * time.Second
	}
	var lastErr error
	for {
		if inst.State == egressproxy.StateRunning && inst.IP != "" {
			return inst, nil
		}
		if inst.State == egressproxy.StateStopped || inst.State == egressproxy.StateFailed {
			return inst, errs.Errorf(egressproxy.Permanent, "instance %s is %s", inst.Name, inst.State)
		}
		select {
		case <-wctx.Done():
			if ctx.Err() != nil {
				return inst, errs.FromContext(ctx.Err())
			}
			return inst, errs.Errorf(egressproxy.Transient, "instance %s not running with an address after %s (state %s; last read error: %v)", inst.Name, d, inst.State, lastErr)
		case <-time.After(every):
		}
		got, err := e.client.Get(wctx, inst.Ref)
		switch {
		case err == nil:
			inst, lastErr = got, nil
		case wctx.Err() != nil:
			// the loop reports it
		case egressproxy.Code(err) == egressproxy.Transient:
			lastErr = err
		default:
			return inst, err
		}
	}
}

// --- delete -----------------------------------------------------------------

func cmdDelete(ctx context.Context, c *cli, args []string) error {
	fs := c.newFlags("delete", "delete NAME [-uid UID]")
	var uid string
	fs.StringVar(&uid, "uid", "", "the instance's UID (default: looked up by NAME; with -uid a missing instance is not an error)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("delete: want one instance NAME, got %q", pos)
	}
	ref := egressproxy.Ref{Name: pos[0], UID: uid}
	if err := naming.ValidateName("NAME", ref.Name); err != nil {
		return usagef("delete: %v", err)
	}
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
	} else if e, err = c.one("delete -uid"); err != nil {
		return err
	}
	_, stop := c.progress(fmt.Sprintf("deleting %s on %s", ref.Name, e.name()))
	err = e.client.Delete(ctx, ref)
	stop()
	if err != nil {
		return entryErr(e, err)
	}
	if c.g.json() {
		return c.printJSON(map[string]any{"deleted": []map[string]string{{"entry": e.name(), "name": ref.Name, "uid": ref.UID}}})
	}
	fmt.Fprintf(c.stdout, "deleted %s (uid %s) on %s\n", ref.Name, ref.UID, e.name())
	return nil
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
	Error      string `json:"error,omitempty"`
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

func cmdProbe(ctx context.Context, c *cli, args []string) error {
	fs := c.newFlags("probe", "probe NAME -target HOST:PORT [-proxy-user U -proxy-password-file F] [-expect-body S] [-probe-timeout D]")
	var target, user, passFile, body string
	var timeout time.Duration
	fs.StringVar(&target, "target", "", "CONNECT target host:port, reachable from the proxy (required)")
	fs.StringVar(&user, "proxy-user", "", "proxy basic-auth user (default: none)")
	fs.StringVar(&passFile, "proxy-password-file", "", "file holding the proxy password (default: $EGRESSPROXYCTL_PROXY_PASSWORD)")
	fs.StringVar(&body, "expect-body", "", "prove the tunnel: GET / through it must answer 200 with exactly this body (target must be plain HTTP)")
	fs.DurationVar(&timeout, "probe-timeout", 10*time.Second, "bound of the probe")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef("probe: want one instance NAME, got %q", pos)
	}
	if host, port, err := net.SplitHostPort(target); err != nil || host == "" || port == "" {
		return usagef("probe: -target %q: want host:port", target)
	}
	password := c.getenv("EGRESSPROXYCTL_PROXY_PASSWORD")
	if passFile != "" {
		b, err := os.ReadFile(passFile)
		if err != nil {
			return usagef("probe: -proxy-password-file: %v", err)
		}
		password = strings.TrimRight(string(b), "\r\n")
	}
	if user == "" {
		password = "" // no user: no credentials at all
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	e, found, err := c.find(ctx, pos[0])
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
	if strings.Contains(user, ":") {
		return usagef("probe: -proxy-user must not contain ':' (RFC 7617 basic auth)")
	}
	opts := health.ProbeOptions{Timeout: timeout, Username: user, Password: password}
	if body != "" {
		opts.Exchange = health.HTTPGet(target, body)
	}
	proxy := inst.Address()
	res := health.Probe(ctx, proxy, target, &opts)
	row := probeRow{Entry: e.name(), Name: inst.Name, Proxy: proxy, Target: target, OK: res.OK,
		StatusCode: res.StatusCode, LatencyMS: res.Total.Milliseconds(), Error: errText(res.Err)}
	if !res.OK {
		row.Kind = res.Kind.String()
	}
	if c.g.json() {
		if err := c.printJSON(row); err != nil {
			return err
		}
	} else {
		ok := "ok"
		if !res.OK {
			ok = "FAILED: " + row.Kind
		}
		c.printTable([]string{"ENTRY", "NAME", "PROXY", "TARGET", "RESULT", "STATUS", "LATENCY", "ERROR"},
			[][]string{{row.Entry, row.Name, row.Proxy, row.Target, ok, strconv.Itoa(row.StatusCode), res.Total.Round(time.Millisecond).String(), row.Error}})
	}
	if !res.OK {
		return entryErr(e, probeErr(res))
	}
	return nil
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

func cmdGC(ctx context.Context, c *cli, args []string) error {
	fs := c.newFlags("gc", "gc -owner OWNER -keep-file FILE [-dry-run] [-allow-empty]")
	var owner, keepFile string
	var dryRun, allowEmpty bool
	fs.StringVar(&owner, "owner", "", "only entries whose owner is this one are collected (required)")
	fs.StringVar(&keepFile, "keep-file", "", "file listing the UIDs to keep, one per line, '#' comments (required)")
	fs.BoolVar(&dryRun, "dry-run", false, "print what would be deleted, delete nothing")
	fs.BoolVar(&allowEmpty, "allow-empty", false, "accept a keep file that lists no UID (deletes every proxy of the owner)")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usagef("gc: no arguments expected, got %q", pos)
	}
	if owner == "" || keepFile == "" {
		return usagef("gc: -owner and -keep-file are required")
	}
	keep, err := readKeepFile(keepFile)
	if err != nil {
		return usagef("gc: -keep-file: %v", err)
	}
	if len(keep) == 0 && !allowEmpty {
		return usagef("gc: %s lists no UID: that would delete every proxy of owner %s; give -allow-empty if that is meant", keepFile, owner)
	}
	if err := c.open(ctx); err != nil {
		return err
	}
	defer c.closeAll()
	var mine []*entry
	for _, e := range c.entries {
		if e.cfg.Owner == owner {
			mine = append(mine, e)
		} else {
			c.note("gc: skipping entry %s: its owner is %s, not %s", e.name(), e.cfg.Owner, owner)
		}
	}
	if len(mine) == 0 {
		return usagef("gc: no selected entry has owner %q", owner)
	}
	c.entries, mine = mine, c.entries // forEach runs over the owner's entries; closeAll still closes all
	defer func() { c.entries = mine }()

	perEntry := make([][]gcRow, len(c.entries))
	kept := make([]int, len(c.entries))
	problems := c.forEach(ctx, func(ctx context.Context, e *entry) error {
		i := indexOf(c.entries, e)
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
				if err := e.client.Delete(ctx, inst.Ref); err != nil {
					r.Action, r.Error = "failed", err.Error()
					problems = append(problems, entryErr(e, err))
				} else {
					r.Action = "deleted"
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
	if c.g.json() {
		if err := c.printJSON(map[string]any{"dryRun": dryRun, "instances": rows, "kept": nkept}); err != nil {
			return err
		}
	} else {
		var table [][]string
		for _, r := range rows {
			table = append(table, []string{r.Entry, r.Name, r.UID, r.Action, r.Error})
		}
		c.printTable([]string{"ENTRY", "NAME", "UID", "ACTION", "ERROR"}, table)
		if dryRun {
			c.note("gc: %d kept, %d would be deleted (dry run)", nkept, len(rows))
		} else {
			failed := 0
			for _, r := range rows {
				if r.Action == "failed" {
					failed++
				}
			}
			c.note("gc: %d kept, %d deleted, %d failed", nkept, len(rows)-failed, failed)
		}
	}
	return worst(problems)
}
