package main

import (
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
)

// The link rows' targets: the library's whole cold fetch against cat | ssh
// and against the virsh pipeline, on the same link.
const (
	targetWholeVsSSH  = 0.85
	targetWholeVsPipe = 1.6
	targetUpVsSSH     = 0.95
	targetRSSOne      = 32.0 // MiB
	targetRSSFour     = 64.0 // MiB
	targetCreates     = 1.3
	targetListS       = 0.5
	targetHitRTT      = 10
	targetColdRTT     = 25
)

func pctList(xs []float64) string {
	var s []string
	for _, x := range xs {
		s = append(s, fmt.Sprintf("%.0f%%", 100*x))
	}
	return strings.Join(s, " / ")
}

// spread is (max-min)/median of xs, as a percentage.
func spread(xs []float64) float64 {
	if len(xs) < 2 || med(xs) == 0 {
		return 0
	}
	lo, hi := xs[0], xs[0]
	for _, x := range xs {
		lo, hi = min(lo, x), max(hi, x)
	}
	return 100 * (hi - lo) / med(xs)
}

// linkReading says where a link-bound fetch's time goes when a target is
// missed: the phases, the link's utilisation in each direction and the
// fetch child's CPU.
func (lr *labRate) linkReading() string {
	s := fmt.Sprintf("where the time goes: the library's whole fetch takes %.1f s (median) for %.0f MB; its upload phase runs at %.0f MB/s and its verify phase at %.0f MB/s; over the whole fetch host 1's link carries %s of %s up (towards the host) and %s down (read-back) per round (cat | ssh: %s up)",
		med(lr.libSeconds), float64(lr.image.Size)/1e6, med(lr.libUpload), med(lr.libVerify), pctList(lr.libTx), lr.spec.rate, pctList(lr.libRx), pctList(lr.sshTx))
	if p := lr.prof; p != nil {
		s += fmt.Sprintf("; the fetch child used %.2f cores (of 2 shared) — %s", p.usage(), p.groupsLine())
	}
	return s + "."
}

func (r *report) renderLab(p func(string, ...any), l *labResult) {
	p("## 6. On the lab: links with finite bandwidth")
	p("")
	how := "brought up by the bench (`scripts/lab up --hosts %d --rate R --rtt 0`, EGRESSPROXY_LAB_DIR=%s), reshaped between rates by `up` again, stopped at the end"
	if l.reused {
		how = "already up (EGRESSPROXY_LAB_DIR=%[2]s); `scripts/lab up --hosts %[1]d --rate R --rtt 0` reshaped it per rate"
	}
	p("The lab (docs/lab.md) %s. Every host has its own libvirtd, sshd and pool behind a veth pair shaped by `tc tbf` in both directions. The single-link rows use host 1's link; rounds interleave the library, `cat | ssh` and the virsh pipeline (order rotated), `sync` after each; %d rounds; ratios are medians of per-round ratios (spread = (max − min) / median).", fmt.Sprintf(how, l.hosts, l.dir), r.opts.labRuns)
	p("")
	p("- **library cold fetch**: `bench -fetch-child -targets <host 1>` under `/usr/bin/time -v` (Ensure: HTTP GET from a local server → upload on a dedicated SSH connection with the overlapped read-back and sha256 on the host → size check → marker; then Evict, untimed). *Upload phase* is imagecache's `imagecache.Upload` span.")
	p("- **cat | ssh**: `cat FILE | ssh … root@HOST 'cat > FILE'` over the same link.")
	p("- **virsh pipeline** (the same guarantee with stock tools): `virsh -c qemu+ssh://… vol-upload` into a fresh raw volume, then `virsh vol-download … /dev/stdout | sha256sum`, digest checked.")
	p("- **link utilisation**: bytes counted on the caller's end of the veth (`/sys/class/net/egplab1/statistics`, headers included) × 8 / wall time / tbf rate.")
	p("")
	for _, lr := range l.rates {
		p("### %s per direction, %d MiB random data → %.0f MB qcow2", lr.spec.rate, lr.spec.imageMiB, float64(lr.image.Size)/1e6)
		p("")
		p("| path | median MB/s | runs (MB/s) |")
		p("| --- | --- | --- |")
		p("| library upload phase | %.1f | %s |", med(lr.libUpload), list(lr.libUpload, "%.1f"))
		p("| library verify phase (read-back + hash, overlapped) | %.1f | %s |", med(lr.libVerify), list(lr.libVerify, "%.1f"))
		p("| library whole cold fetch | %.1f | %s |", med(lr.libWhole), list(lr.libWhole, "%.1f"))
		p("| cat \\| ssh 'cat > file' | %.1f | %s |", med(lr.ssh), list(lr.ssh, "%.1f"))
		p("| virsh pipeline (vol-upload, then vol-download \\| sha256sum) | %.1f | %s |", med(lr.pipe), list(lr.pipe, "%.1f"))
		p("| — its vol-upload / its vol-download \\| sha256sum | %.1f / %.1f | %s / %s |", med(lr.pipeUp), med(lr.pipeDown), list(lr.pipeUp, "%.1f"), list(lr.pipeDown, "%.1f"))
		p("")
		p("Link utilisation of host 1's link (%s): library fetch up %s, down %s; cat | ssh up %s.", lr.spec.rate, pctList(lr.libTx), pctList(lr.libRx), pctList(lr.sshTx))
		p("")
		p("| ratio (paired) | median | per round | spread | target | reading |")
		p("| --- | --- | --- | --- | --- | --- |")
		for _, x := range lr.ratioRows() {
			p("| %s | %.2f× | %s | %.0f%% | %s | %s |", x.name, med(x.v), list(x.v, "%.2f"), spread(x.v), x.target, verdict(x.ok))
		}
		p("")
		rss1, rss4 := med(lr.rssKiB)/1024, med(lr.multiRSSKiB)/1024
		p("Peak RSS (`/usr/bin/time -v`, the whole child process): one cold fetch %s MiB → median **%.1f MiB** (target ≤ %.0f MiB: %s).", list(mib(lr.rssKiB), "%.1f"), rss1, targetRSSOne, verdict(rss1 <= targetRSSOne))
		if len(lr.multiRSSKiB) > 0 {
			p("%d concurrent cold fetches to %d hosts in one child: %s MiB → median **%.1f MiB** (target ≤ %.0f MiB: %s), in %s s.", lr.multiHosts, lr.multiHosts, list(mib(lr.multiRSSKiB), "%.1f"), rss4, targetRSSFour, verdict(rss4 <= targetRSSFour), list(lr.multiWallS, "%.1f"))
		}
		p("")
		if len(lr.multiRSSKiB) > 0 && rss4 > targetRSSFour {
			p("Reading (generated): the %d-fetch child peaks %.1f MiB above the one-fetch child, %.1f MiB per extra concurrent fetch (each has its own SSH connections, upload and read-back buffers and hash state); the Go runtime's heap goal (GOGC=100) lets the heap grow to about twice the live data before collecting.", lr.multiHosts, rss4-rss1, (rss4-rss1)/float64(lr.multiHosts-1))
			p("")
		}
		missed := false
		for _, x := range lr.ratioRows() {
			missed = missed || !x.ok
		}
		if missed {
			p("Reading (generated): %s", lr.linkReading())
			p("")
		}
		if lr.prof != nil {
			lr.prof.render(p, fmt.Sprintf("CPU profile of the last library fetch at %s", lr.spec.rate))
		}
		if c := lr.creates; c != nil {
			ratio := med(c.manyVsOne)
			p("**Concurrent Creates at %s**: %d concurrent Creates on 1 host vs %d on each of %d hosts at once (%d in all); each run opens a fresh kvm2 entry per host, so each host cold-fetches the %d MiB image once (the 5 Creates of a host share it) and then defines and starts 5 TCG guests; instances and base deleted after each run (untimed). Interleaved, order alternated.", lr.spec.rate, c.per, c.per, c.hosts, c.per*c.hosts, lr.spec.imageMiB)
			p("")
			p("| | median s | runs (s) |")
			p("| --- | --- | --- |")
			p("| 1 host × %d | %.1f | %s |", c.per, med(c.one), list(c.one, "%.1f"))
			p("| %d hosts × %d | %.1f | %s |", c.hosts, c.per, med(c.many), list(c.many, "%.1f"))
			p("")
			p("Time ratio %d hosts / 1 host (paired): median **%.2f×** (%s, spread %.0f%%) — target ≤ %.1f×: %s.", c.hosts, ratio, list(c.manyVsOne, "%.2f"), spread(c.manyVsOne), targetCreates, verdict(ratio <= targetCreates))
			p("")
			if w := c.where(); w != "" {
				p("Where the time goes (generated): %s", w)
				p("")
			}
			if ratio > targetCreates {
				p("Reading (generated): %s", c.reading(med(lr.libSeconds)))
				p("")
			}
		}
	}
}

// where says, from each run's CPU figures and each host's finish times,
// whether the hosts waited for each other (a library that serialised them
// would finish them a fetch's time apart) and how busy the machine was;
// "" when the run recorded none (an older report).
func (c *createsResult) where() string {
	if len(c.runsMany) == 0 || len(c.runsOne) == 0 {
		return ""
	}
	hosts := func(runs []createsRun, what func(createsRun) []float64) string {
		var out []string
		for _, r := range runs {
			out = append(out, list(what(r), "%.1f"))
		}
		if len(runs) > 0 && len(what(runs[0])) == 1 {
			return strings.Join(out, " / ") // one host: one figure per run
		}
		return strings.Join(out, "; ")
	}
	first := func(r createsRun) []float64 { return r.first }
	last := func(r createsRun) []float64 { return r.last }
	worst := 0.0
	for i, r := range c.runsMany {
		if i < len(c.many) && c.many[i] > 0 && len(r.last) > 0 {
			worst = max(worst, (slices.Max(r.last)-slices.Min(r.last))/c.many[i])
		}
	}
	field := func(runs []createsRun, f func(createsRun) float64, scale float64, format string) string {
		v := make([]float64, len(runs))
		for i, r := range runs {
			v[i] = scale * f(r)
		}
		return list(v, format)
	}
	busy := func(r createsRun) float64 { return r.busy }
	iowait := func(r createsRun) float64 { return r.iowait }
	cpu := func(r createsRun) float64 { return r.cpu }
	return fmt.Sprintf("1 host × %d: its first Create returned (the cold fetch done) at %s s, its last at %s s (per run). %d hosts × %d, hosts 1–%d: first at %s s, last at %s s (per run): the hosts finish within %.0f%% of the run's time of each other, so none waited for another's fetch (serialised fetches would finish a fetch's time apart). The machine's CPU (all cores, /proc/stat) was %s%% busy and %s%% waiting for I/O during 1 host × %d, %s%% busy and %s%% waiting during %d hosts × %d; this process (the library: SSH cipher, hashing, libvirt RPC) used %s CPU s and %s CPU s.",
		c.per, hosts(c.runsOne, first), hosts(c.runsOne, last),
		c.hosts, c.per, c.hosts, hosts(c.runsMany, first), hosts(c.runsMany, last), 100*worst,
		field(c.runsOne, busy, 100, "%.0f"), field(c.runsOne, iowait, 100, "%.0f"), c.per,
		field(c.runsMany, busy, 100, "%.0f"), field(c.runsMany, iowait, 100, "%.0f"), c.hosts, c.per,
		field(c.runsOne, cpu, 1, "%.1f"), field(c.runsMany, cpu, 1, "%.1f"))
}

// reading says where the time of the concurrent Creates goes, given the
// median wall time of one cold fetch alone on the same link.
func (c *createsResult) reading(fetchS float64) string {
	one, many := med(c.one), med(c.many)
	if len(c.runsMany) > 0 && len(c.runsOne) > 0 {
		busy := func(runs []createsRun) float64 {
			v := make([]float64, len(runs))
			for i, r := range runs {
				v[i] = r.busy
			}
			return med(v)
		}
		cpu := "the machine's cores were not saturated either, so the time is neither CPU nor the links: look at the per-host finish times above"
		if b := busy(c.runsMany); b >= 0.9 {
			cpu = fmt.Sprintf("the machine's cores were %.0f%% busy over the %d-host runs (%.0f%% over the 1-host runs), so the limit is CPU: %d TCG guests starting, %d fetches' SSH cipher and hashing and %d sshd/libvirtd pairs on the same cores (load average before the runs: %s)",
				100*b, c.hosts, 100*busy(c.runsOne), c.hosts*c.per, c.hosts, c.hosts, c.load)
		}
		var firstOne []float64
		for _, r := range c.runsOne {
			firstOne = append(firstOne, r.first...)
		}
		fetch := med(firstOne)
		return fmt.Sprintf("1 host × %d takes %.1f s, of which %.1f s until its first Create returned (the cold fetch, plus a few calls) and about %.1f s more for the Creates' own work after it (volumes, define, start of %d TCG guests); %d hosts × %d take %.1f s more than 1 × %d. Each host has its own link and the hosts finish together (above): %s.",
			c.per, one, fetch, one-fetch, c.per, c.hosts, c.per, many-one, c.per, cpu)
	}
	return fmt.Sprintf("one cold fetch alone takes %.1f s on this link (library rows above); 1 host × %d takes %.1f s, so about %.1f s are the Creates' own work after the fetch (volumes, define, start of %d TCG guests); %d hosts × %d take %.1f s more than 1 × %d. Each host has its own link, so the links do not add up: the extra time is CPU — %d TCG guests starting, %d fetches' SSH cipher and hashing and %d sshd/libvirtd pairs on 2 cores shared with other jobs (load average before the runs: %s). Compare with a quieter rerun before looking for serialisation in the library.",
		fetchS, c.per, one, one-fetchS, c.per, c.hosts, c.per, many-one, c.per, c.hosts*c.per, c.hosts, c.hosts, c.load)
}

type ratioRow struct {
	name, target string
	v            []float64
	ok           bool
}

func (lr *labRate) ratioRows() []ratioRow {
	return []ratioRow{
		{"library whole cold fetch / cat \\| ssh", fmt.Sprintf("≥ %.2f×", targetWholeVsSSH), lr.wholeVsSSH, med(lr.wholeVsSSH) >= targetWholeVsSSH},
		{"library whole cold fetch / virsh pipeline", fmt.Sprintf("≥ %.1f×", targetWholeVsPipe), lr.wholeVsPipe, med(lr.wholeVsPipe) >= targetWholeVsPipe},
		{"library upload phase / cat \\| ssh", fmt.Sprintf("≥ %.2f×", targetUpVsSSH), lr.upVsSSH, med(lr.upVsSSH) >= targetUpVsSSH},
	}
}

func (r *report) renderRTT(p func(string, ...any), x *rttResult) {
	ms := x.rtt.Milliseconds()
	p("## 7. Round-trip time: the control path through a %d ms delay proxy", ms)
	p("")
	p("On the stack, one kvm2 entry opened twice: on the stack's sshd (loopback) and through an in-process delay proxy (internal/testing/lab/delayproxy, +%d ms RTT) in front of it; both reach libvirtd through the RPC counter. Round trips on the critical path are counted by it (`benchutil.RPCCounter.Rounds`: calls and upload-stream ends that passed more than RTT/2 after the one before; calls issued together count once). *Beyond loopback* is (median through the proxy − median on loopback) / RTT, which also counts the SSH handshakes of a dedicated connection. Loopback and proxy runs alternate.", ms)
	p("")
	p("| operation | RPCs | loopback ms | through the proxy ms | runs through the proxy (ms) | round trips on the critical path | beyond loopback (RTT) | target | reading |")
	p("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	hit, cold := med(x.hit.rounds), med(x.cold.rounds)
	p("| Create, cache hit (starts the domain) | %.0f | %.0f | %.0f | %s | %.0f (%s) | %.1f | ≤ %d RTT | %s |", med(x.hit.remote.rpcs), med(x.hit.direct.wallMS), med(x.hit.remote.wallMS), list(x.hit.remote.wallMS, "%.0f"), hit, list(x.hit.rounds, "%.0f"), x.hit.beyond(x.rtt), targetHitRTT, verdict(hit <= targetHitRTT))
	p("| Create, cold (fetches the ~200 KB blank base: transfer negligible) | %.0f | %.0f | %.0f | %s | %.0f (%s) | %.1f | ≤ %d RTT + transfer | %s |", med(x.cold.remote.rpcs), med(x.cold.direct.wallMS), med(x.cold.remote.wallMS), list(x.cold.remote.wallMS, "%.0f"), cold, list(x.cold.rounds, "%.0f"), x.cold.beyond(x.rtt), targetColdRTT, verdict(cold <= targetColdRTT))
	listS := med(x.list.remote.wallMS) / 1000
	p("| List of %d (powered off) | %.0f | %.0f | %.0f | %s | %.0f (%s) | %.1f | ≤ %.1f s | %s |", x.n, med(x.list.remote.rpcs), med(x.list.direct.wallMS), med(x.list.remote.wallMS), list(x.list.remote.wallMS, "%.0f"), med(x.list.rounds), list(x.list.rounds, "%.0f"), x.list.beyond(x.rtt), targetListS, verdict(listS <= targetListS))
	p("| sequential List of %d (1 + 2n calls one after another, go-libvirt, same proxy) | %d | — | %.0f | %s | %d | — | — | measured |", x.n, x.seqRPCs, med(x.seqMS), list(x.seqMS, "%.0f"), x.seqRPCs)
	p("")
	p("RPCs made (through the proxy): cache-hit Create %s; cold Create %s; List %s.", x.hit.remote.typical(), x.cold.remote.typical(), x.list.remote.typical())
	p("")
	if x.coldTimeline != "" {
		p("Calls of the last cold Create through the proxy, in order (`*` starts a round trip; +ms since the call before): %s.", x.coldTimeline)
		p("")
	}
	if cold > targetColdRTT {
		p("Reading (generated): the cold Create waits for %.0f answers one after another (%.0f RPCs in all, %s): each of them costs a round trip through the proxy, and the SSH handshake of the upload's dedicated connection (dialled while the claim is taken) adds round trips that the counter does not see but the wall time does when it outlasts the calls it overlaps (%.1f RTT beyond loopback).", cold, med(x.cold.remote.rpcs), x.cold.remote.typical(), x.cold.beyond(x.rtt))
		p("")
	}
}

// mergeReports keeps, from the old report, every numbered section ("## N.")
// the new one lacks and every summary row whose figure it lacks, marking
// them as kept from the earlier run.
func mergeReports(old, nw string) string {
	oldHead, _, _ := strings.Cut(old, analysisMarker)
	newHead, newTail, ok := strings.Cut(nw, analysisMarker)
	if !ok {
		return nw
	}
	oldSecs, _ := sections(oldHead)
	newSecs, order := sections(newHead)
	oldRun := ""
	if m := regexp.MustCompile(`Run (\d{4}-\d\d-\d\d \d\d:\d\d) – (\d\d:\d\d) UTC`).FindStringSubmatch(oldHead); m != nil {
		oldRun = m[1] + "–" + m[2] + " UTC"
	}
	var kept []string
	for k, v := range oldSecs {
		if _, have := newSecs[k]; !have && numbered(k) {
			newSecs[k] = v + fmt.Sprintf("*(Section kept from the earlier run of %s: this run did not measure it.)*\n\n", oldRun)
			order = append(order, k)
			kept = append(kept, k)
		}
	}
	sort.SliceStable(order, func(i, j int) bool { return secRank(order[i]) < secRank(order[j]) })
	// Summary: the new rows, then the old rows of figures it lacks.
	if osum, ok := oldSecs["Summary"]; ok {
		ns := newSecs["Summary"]
		if ns == "" {
			ns = "## Summary\n\n| figure | median | target | reading |\n| --- | --- | --- | --- |\n"
			order = append(order, "Summary")
		}
		have := map[string]bool{}
		for _, l := range strings.Split(ns, "\n") {
			have[rowKey(l)] = true
		}
		var add []string
		for _, l := range strings.Split(osum, "\n") {
			if k := rowKey(l); k != "" && !have[k] && !strings.HasPrefix(l, "| figure") && !strings.HasPrefix(l, "| ---") {
				l = strings.TrimSuffix(strings.TrimRight(l, " "), " |")
				add = append(add, l+fmt.Sprintf(" *(earlier run, %s)* |", oldRun))
			}
		}
		if len(add) > 0 {
			ns = strings.TrimRight(ns, "\n") + "\n" + strings.Join(add, "\n") + "\n"
		}
		newSecs["Summary"] = ns
	}
	if len(kept) > 0 {
		sort.Slice(kept, func(i, j int) bool { return secRank(kept[i]) < secRank(kept[j]) })
		k := "Command"
		if _, ok := newSecs[k]; !ok {
			k = ""
		}
		newSecs[k] = strings.TrimRight(newSecs[k], "\n") + fmt.Sprintf("\n\nThis report merges (`-merge`) the sections of this run with sections %s kept from the earlier run of %s (their command, machine and load were those of that run).\n\n", strings.Join(kept, ", "), oldRun)
	}
	var b strings.Builder
	for _, k := range order {
		b.WriteString(newSecs[k])
	}
	return strings.TrimRight(b.String(), "\n") + "\n" + analysisMarker + newTail
}

// sections splits a report at its "## " headings, keyed by the heading's
// number ("6.") or, unnumbered, its title ("Summary"); "" is the preamble.
func sections(doc string) (map[string]string, []string) {
	out := map[string]string{}
	var order []string
	key := ""
	order = append(order, key)
	for _, l := range strings.SplitAfter(doc, "\n") {
		if t, ok := strings.CutPrefix(l, "## "); ok {
			key = secKey(strings.TrimSpace(t))
			if _, dup := out[key]; !dup {
				order = append(order, key)
			}
		}
		out[key] += l
	}
	return out, order
}

func secKey(title string) string {
	if f, _, _ := strings.Cut(title, " "); strings.HasSuffix(f, ".") && strings.Trim(f, "0123456789.") == "" {
		return f
	}
	return title
}

func numbered(k string) bool {
	return strings.HasSuffix(k, ".") && strings.Trim(k, "0123456789.") == ""
}

// secRank orders sections: preamble and unnumbered ones before the
// numbered (Command, Machine), numbered by number, Summary last.
func secRank(k string) int {
	switch {
	case k == "Summary":
		return 1000
	case numbered(k):
		n := 0
		fmt.Sscanf(k, "%d.", &n)
		return 100 + n
	}
	return 0
}

// rowKey is a summary row's figure (first cell), "" for other lines.
func rowKey(l string) string {
	if !strings.HasPrefix(l, "| ") {
		return ""
	}
	f := strings.SplitN(l[2:], " | ", 2)
	return strings.TrimSpace(f[0])
}
