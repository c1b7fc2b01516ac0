package soak

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"
)

// Kind is the kind of a scheduled step: an operation on the desired set or
// a fault.
type Kind string

// Operations: changes of the desired set the model operator makes.
const (
	OpCreate Kind = "create"       // a new proxy joins the desired set
	OpDelete Kind = "delete"       // a proxy leaves it
	OpSpec   Kind = "spec-change"  // a proxy's port changes (a new UID)
	OpImage  Kind = "image-change" // a proxy's image key changes (a new UID)
)

// Faults. Each is transient: nothing the soak injects may cause a Permanent
// error.
const (
	FaultSSHDFreeze      Kind = "sshd-freeze"      // SIGSTOP the host's sshd and its sessions, SIGCONT after Dur
	FaultSSHDKill        Kind = "sshd-kill"        // stop the host's sshd, start it after Dur
	FaultLinkDown        Kind = "link-down"        // the host's link down, up after Dur
	FaultLinkSlow        Kind = "link-slow"        // the host's link rate dropped to 1 Mbit/s for Dur
	FaultLibvirtdRestart Kind = "libvirtd-restart" // restart the host's libvirtd (Dur unused)
	FaultDriverKill      Kind = "driver-sigkill"   // SIGKILL the driver process, start it again after Dur: it must recover from List alone
	FaultReplica         Kind = "second-replica"   // a second driver process (own entries, same owner) reconciles the host beside the first for Dur
	FaultRTT             Kind = "rtt-400ms"        // the host's delay proxy adds 400 ms of round-trip time for Dur
	FaultPoolFull        Kind = "pool-full"        // the host's (tmpfs) pool is filled by a planted file for Dur
	FaultMirror503       Kind = "mirror-503"       // the image mirror answers 503 for Dur
	FaultMirrorStall     Kind = "mirror-stall"     // it stalls mid-body for Dur
	FaultMirrorShort     Kind = "mirror-short"     // it cuts the body short for Dur
)

// OpKinds and FaultKinds list every kind, in report order.
var (
	OpKinds    = []Kind{OpCreate, OpDelete, OpSpec, OpImage}
	FaultKinds = []Kind{FaultSSHDFreeze, FaultSSHDKill, FaultLinkDown, FaultLinkSlow, FaultRTT, FaultLibvirtdRestart, FaultPoolFull, FaultDriverKill, FaultReplica, FaultMirror503, FaultMirrorStall, FaultMirrorShort}
)

// IsFault reports whether k is a fault kind.
func (k Kind) IsFault() bool { return slices.Contains(FaultKinds, k) }

// HostFault reports whether k is a fault of one lab host (not of the mirror).
func (k Kind) HostFault() bool {
	switch k {
	case FaultSSHDFreeze, FaultSSHDKill, FaultLinkDown, FaultLinkSlow, FaultRTT, FaultLibvirtdRestart, FaultPoolFull, FaultReplica:
		return true
	}
	return false
}

// Step is one scheduled operation or fault.
type Step struct {
	At   time.Duration `json:"at"`   // since the run's start
	Kind Kind          `json:"kind"` // an Op* or Fault* kind
	// Host is the lab host (1..Hosts) of a host fault or of the slot of an
	// operation; 0 for mirror faults and driver-sigkill (the driver runs
	// every host's reconciler).
	Host int `json:"host,omitempty"`
	// Slot is the proxy slot an operation concerns (0..MaxProxies-1); each
	// slot lives on host Slot%Hosts+1.
	Slot int `json:"slot,omitempty"`
	// Gen is the slot's generation after the operation: a new UID for
	// every create, spec change and image change.
	Gen int `json:"gen,omitempty"`
	// Port and Image are the slot's spec after a create, spec or image
	// change.
	Port  int    `json:"port,omitempty"`
	Image string `json:"image,omitempty"`
	// Dur is how long a fault lasts.
	Dur time.Duration `json:"dur,omitempty"`
}

func (s Step) String() string {
	if s.Kind.IsFault() {
		return fmt.Sprintf("%v %s host=%d dur=%v", s.At, s.Kind, s.Host, s.Dur)
	}
	return fmt.Sprintf("%v %s slot=%d host=%d gen=%d port=%d image=%s", s.At, s.Kind, s.Slot, s.Host, s.Gen, s.Port, s.Image)
}

// Params shape a schedule.
type Params struct {
	Seed     uint64
	Duration time.Duration // the whole run, quiet period included
	Hosts    int
	// MinProxies..MaxProxies is the size the desired set keeps (after the
	// initial creates at time 0, which bring it to MinProxies).
	MinProxies, MaxProxies int
	// OpEvery and FaultEvery are the mean intervals between operations and
	// between the starts of faults (exponentially distributed).
	OpEvery, FaultEvery time.Duration
	// FaultMin..FaultMax bounds a fault's duration.
	FaultMin, FaultMax time.Duration
	// Quiet is the end of the run without operations or faults, in which
	// the fleet must converge.
	Quiet time.Duration
	// Images are the image keys specs choose from (at least one).
	Images []string
	// Faults restricts the fault kinds; nil means FaultKinds.
	Faults []Kind
	// PoolHost is the host whose pool is a small tmpfs, the one a
	// pool-full fault fills; 0: no such host, no pool-full faults.
	PoolHost int
	// DriverDownMax bounds how long a SIGKILLed driver stays down before
	// it is started again (a fault's duration, capped).
	DriverDownMax time.Duration
}

// DefaultParams are the soak's parameters for a run of d on hosts hosts.
func DefaultParams(seed uint64, d time.Duration, hosts int) Params {
	quiet := min(max(d/5, time.Minute), 5*time.Minute)
	return Params{
		Seed: seed, Duration: d, Hosts: hosts,
		// 8..12 per host: about 30 on the default 3 hosts, as an
		// operator's fleet of a few hypervisors holds.
		MinProxies: 8 * hosts, MaxProxies: 12 * hosts,
		OpEvery: 4 * time.Second, FaultEvery: 12 * time.Second,
		FaultMin: 3 * time.Second, FaultMax: 15 * time.Second,
		Quiet: quiet,
		// Six keys, so that a host often has keys no proxy uses: the
		// driver evicts those, and the next Create of one fetches it again
		// through the mirror and its faults.
		Images:   []string{"tiny", "tiny2", "tiny3", "tiny4", "tiny5", "tiny6"},
		PoolHost: 1, DriverDownMax: 5 * time.Second,
	}
}

// Validate reports a Params no schedule can be made from.
func (p Params) Validate() error {
	switch {
	case p.Hosts < 1:
		return fmt.Errorf("soak: Hosts %d: need at least 1", p.Hosts)
	case p.MinProxies < 1 || p.MaxProxies < p.MinProxies:
		return fmt.Errorf("soak: proxies %d..%d: need 1 <= min <= max", p.MinProxies, p.MaxProxies)
	case p.OpEvery <= 0 || p.FaultEvery <= 0:
		return fmt.Errorf("soak: OpEvery and FaultEvery must be positive")
	case p.FaultMin <= 0 || p.FaultMax < p.FaultMin:
		return fmt.Errorf("soak: fault durations %v..%v: need 0 < min <= max", p.FaultMin, p.FaultMax)
	case p.Quiet < 0 || p.Quiet >= p.Duration:
		return fmt.Errorf("soak: Quiet %v must be in [0, Duration %v)", p.Quiet, p.Duration)
	case len(p.Images) == 0:
		return fmt.Errorf("soak: no Images")
	case p.PoolHost < 0 || p.PoolHost > p.Hosts:
		return fmt.Errorf("soak: PoolHost %d: want 0 (none) or a host 1..%d", p.PoolHost, p.Hosts)
	}
	return nil
}

// ParseSeed parses a seed as printed by the soak (decimal); "" yields a
// random one.
func ParseSeed(s string) (uint64, error) {
	if s == "" {
		return rand.Uint64(), nil
	}
	v, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("soak: seed %q: must be a decimal uint64", s)
	}
	return v, nil
}

// slot is the model's state of one proxy slot while the schedule is made.
type slot struct {
	live  bool
	gen   int
	port  int
	image string
}

// NewSchedule makes the schedule of p: the initial creates at time 0, then
// operations and faults at random times until Duration-Quiet, sorted by At
// (operations before faults at the same instant). Faults never overlap
// (each starts after the previous one ended), so the time to recover is
// that of one fault. The same Params give the same schedule.
func NewSchedule(p Params) ([]Step, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	faults := p.Faults
	if faults == nil {
		faults = FaultKinds
	}
	if p.PoolHost == 0 {
		faults = slices.DeleteFunc(slices.Clone(faults), func(k Kind) bool { return k == FaultPoolFull })
	}
	if len(faults) == 0 {
		return nil, fmt.Errorf("soak: no fault kinds left")
	}
	// Two streams from the seed, so that changing fault parameters leaves
	// the operations as they were.
	opRNG := rand.New(rand.NewPCG(p.Seed, 0x6f7073)) // "ops"
	faultRNG := rand.New(rand.NewPCG(p.Seed, 0x666c74))
	end := p.Duration - p.Quiet
	exp := func(r *rand.Rand, mean time.Duration) time.Duration {
		return time.Duration(r.ExpFloat64() * float64(mean))
	}
	slots := make([]slot, p.MaxProxies)
	live := 0
	var steps []Step
	hostOf := func(i int) int { return i%p.Hosts + 1 }
	port := func() int { return 3128 + opRNG.IntN(64) }
	image := func() string { return p.Images[opRNG.IntN(len(p.Images))] }
	create := func(at time.Duration, i int) {
		s := &slots[i]
		s.live, s.gen, s.port, s.image = true, s.gen+1, port(), image()
		live++
		steps = append(steps, Step{At: at, Kind: OpCreate, Host: hostOf(i), Slot: i, Gen: s.gen, Port: s.port, Image: s.image})
	}
	pick := func(want bool) int { // a random slot whose liveness is want
		var c []int
		for i, s := range slots {
			if s.live == want {
				c = append(c, i)
			}
		}
		return c[opRNG.IntN(len(c))]
	}
	for i := range p.MinProxies {
		create(0, i)
	}
	for at := exp(opRNG, p.OpEvery); at < end; at += exp(opRNG, p.OpEvery) {
		var k Kind
		switch {
		case live <= p.MinProxies && live < p.MaxProxies:
			k = OpCreate
		case live >= p.MaxProxies:
			k = []Kind{OpDelete, OpSpec, OpImage}[opRNG.IntN(3)]
		default:
			k = OpKinds[opRNG.IntN(len(OpKinds))]
		}
		switch k {
		case OpCreate:
			create(at, pick(false))
		case OpDelete:
			i := pick(true)
			slots[i].live = false
			live--
			steps = append(steps, Step{At: at, Kind: OpDelete, Host: hostOf(i), Slot: i, Gen: slots[i].gen})
		case OpSpec, OpImage:
			i := pick(true)
			s := &slots[i]
			s.gen++
			if k == OpSpec {
				for old := s.port; s.port == old; {
					s.port = port()
				}
			} else if len(p.Images) > 1 {
				for old := s.image; s.image == old; {
					s.image = image()
				}
			}
			steps = append(steps, Step{At: at, Kind: k, Host: hostOf(i), Slot: i, Gen: s.gen, Port: s.port, Image: s.image})
		}
	}
	var fsteps []Step
	for at := exp(faultRNG, p.FaultEvery); ; {
		k := faults[faultRNG.IntN(len(faults))]
		d := p.FaultMin + time.Duration(faultRNG.Int64N(int64(p.FaultMax-p.FaultMin)+1))
		d = d.Truncate(time.Millisecond)
		host := 0
		if k.HostFault() {
			host = faultRNG.IntN(p.Hosts) + 1
		}
		switch k {
		case FaultLibvirtdRestart:
			d = 0
		case FaultPoolFull:
			host = p.PoolHost
		case FaultDriverKill:
			if p.DriverDownMax > 0 {
				d = min(d, p.DriverDownMax)
			}
		}
		at = at.Truncate(time.Millisecond)
		if at+d >= end {
			break
		}
		fsteps = append(fsteps, Step{At: at, Kind: k, Host: host, Dur: d})
		at += d + exp(faultRNG, p.FaultEvery)
	}
	for i := range steps {
		steps[i].At = steps[i].At.Truncate(time.Millisecond)
	}
	steps = append(steps, fsteps...)
	slices.SortStableFunc(steps, func(a, b Step) int {
		if a.At != b.At {
			if a.At < b.At {
				return -1
			}
			return 1
		}
		if a.Kind.IsFault() != b.Kind.IsFault() {
			if b.Kind.IsFault() {
				return -1
			}
			return 1
		}
		return 0
	})
	return steps, nil
}
