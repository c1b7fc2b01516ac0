package drivertest

import (
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/driver"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// conformanceTests is the suite, in the order it runs. Names are stable:
// a provider's test may select them with -run.
var conformanceTests = []struct {
	name string
	fn   func(*env)
}{
	{"Check/ReachableWithoutCreating", testCheckReachable},
	{"Check/CapacityCountsRunningInstances", testCheckCapacity},
	{"Create/ReturnsInstance", testCreateReturnsInstance},
	{"Create/IdempotentOnUID", testCreateIdempotent},
	{"Create/ConcurrentSameSpec", testCreateConcurrent},
	{"Create/NameTakenByOtherUID", testCreateNameTaken},
	{"Create/InvalidSpecIsPermanentAndCreatesNothing", testCreateInvalidSpec},
	{"Create/NameReusableAfterDelete", testCreateAfterDelete},
	{"Create/SpecDigestReadBack", testCreateSpecDigest},
	{"Create/OtherSpecIsConflict", testCreateSpecConflict},
	{"Get/ReadsBackStableIdentity", testGetReadsBack},
	{"Get/MissingIsNotFound", testGetMissing},
	{"Get/WrongUIDIsNotFound", testGetWrongUID},
	{"Get/InvalidRefIsPermanent", testGetInvalidRef},
	{"Delete/Removes", testDeleteRemoves},
	{"Delete/MissingSucceeds", testDeleteMissing},
	{"Delete/WrongUIDKeepsInstance", testDeleteWrongUID},
	{"Delete/StorageGoneIsNeverNotFound", testDeleteStorageGone},
	{"List/Exact", testListExact},
	{"List/OtherEntryInvisible", testOtherEntryInvisible},
	{"State/ReachesRunning", testReachesRunning},
	{"Context/CanceledBeforeCall", testContextCanceled},
	{"Context/DeadlineExceededBeforeCall", testContextDeadline},
	{"Close/CallsAfterCloseFail", testCallsAfterClose},
	{"Close/Idempotent", testCloseIdempotent},
	{"Client/ErrorsNameOperationAndInstance", testClientErrors},
	{"Images/ListShowsConfiguredKeys", testImagesList},
	{"Images/CreateUsesImage", testImagesCreateUsesImage},
	{"Images/EvictRefusedWhileInUse", testImagesEvictRefusedWhileInUse},
	{"Images/VerifyAbsentIsNotFound", testImagesVerifyAbsentIsNotFound},
	{"Images/UnknownKeyIsPermanent", testImagesUnknownKeyIsPermanent},
}

// ---- helpers ----

func (e *env) fatalf(format string, args ...any) {
	e.t.Helper()
	e.t.Fatalf(format, args...)
}

func (e *env) create(spec egressproxy.Spec) egressproxy.Instance {
	e.t.Helper()
	inst, err := e.c.Create(e.ctx, spec)
	if err != nil {
		e.fatalf("Create(%s): %v", spec.Name, err)
	}
	e.checkInstance("Create", inst, spec.Ref())
	return inst
}

func (e *env) get(ref egressproxy.Ref) egressproxy.Instance {
	e.t.Helper()
	inst, err := e.c.Get(e.ctx, ref)
	if err != nil {
		e.fatalf("Get(%s): %v", ref.Name, err)
	}
	e.checkInstance("Get", inst, ref)
	return inst
}

func (e *env) list() []egressproxy.Instance {
	e.t.Helper()
	l, err := e.c.List(e.ctx)
	if err != nil {
		e.fatalf("List: %v", err)
	}
	return l
}

var validStates = map[egressproxy.State]bool{
	egressproxy.StateProvisioning: true, egressproxy.StateRunning: true,
	egressproxy.StateStopped: true, egressproxy.StateFailed: true,
}

// checkInstance checks the shape every instance read from a provider has.
func (e *env) checkInstance(op string, inst egressproxy.Instance, want egressproxy.Ref) {
	e.t.Helper()
	for _, p := range instanceProblems(inst, want, true) {
		e.t.Errorf("%s(%s): %s (instance %+v)", op, want.Name, p, inst)
	}
}

// instanceProblems lists contract violations of one read instance.
// addresses=false is for List, where addresses may be left empty.
func instanceProblems(inst egressproxy.Instance, want egressproxy.Ref, addresses bool) []string {
	var out []string
	if inst.Name != want.Name {
		out = append(out, "Name = "+strconv.Quote(inst.Name)+", want "+strconv.Quote(want.Name))
	}
	if inst.UID != want.UID {
		out = append(out, "UID = "+strconv.Quote(inst.UID)+", want "+strconv.Quote(want.UID))
	}
	if inst.CreatedAt.IsZero() {
		out = append(out, "CreatedAt is zero")
	} else if d := time.Since(inst.CreatedAt); d < -time.Hour || d > 24*time.Hour {
		out = append(out, "CreatedAt "+inst.CreatedAt.String()+" is not a plausible creation time")
	}
	if !validStates[inst.State] {
		out = append(out, "State "+strconv.Quote(string(inst.State))+" is not one of the four states")
	}
	if inst.State == egressproxy.StateProvisioning && inst.IP != "" {
		out = append(out, "Provisioning instance has IP "+inst.IP+" (Provisioning means no address yet)")
	}
	if inst.IP == "" && inst.AddressSource != "" {
		out = append(out, "AddressSource "+strconv.Quote(inst.AddressSource)+" without an IP")
	}
	if inst.IP != "" {
		if net.ParseIP(inst.IP) == nil {
			out = append(out, "IP "+strconv.Quote(inst.IP)+" is not an IP address")
		}
		if inst.Port < 1 || inst.Port > 65535 {
			out = append(out, "Port "+strconv.Itoa(inst.Port)+" out of range with an IP")
		}
	}
	if addresses && inst.State == egressproxy.StateRunning && inst.IP == "" {
		out = append(out, "Running instance has no IP (Running means it has an address)")
	}
	return out
}

func sameSecond(a, b time.Time) bool {
	return a.Truncate(time.Second).Equal(b.Truncate(time.Second))
}

// wantCode fails unless err has the class want.
func (e *env) wantCode(what string, err error, want egressproxy.ErrorCode) {
	e.t.Helper()
	if got := egressproxy.Code(err); got != want {
		e.t.Errorf("%s: error class = %v, want %v (err: %v)", what, got, want, err)
	}
}

// byName indexes a List result, failing on duplicate names.
func (e *env) byName(l []egressproxy.Instance) map[string]egressproxy.Instance {
	e.t.Helper()
	m := make(map[string]egressproxy.Instance, len(l))
	for _, inst := range l {
		if prev, dup := m[inst.Name]; dup {
			e.t.Errorf("List has %q twice (UIDs %q and %q): a duplicate", inst.Name, prev.UID, inst.UID)
		}
		m[inst.Name] = inst
	}
	return m
}

// wantList checks List == baseline + want exactly (by name and UID).
func (e *env) wantList(baseline map[string]egressproxy.Instance, want ...egressproxy.Ref) map[string]egressproxy.Instance {
	e.t.Helper()
	got := e.byName(e.list())
	exp := map[string]string{}
	for n, inst := range baseline {
		exp[n] = inst.UID
	}
	for _, r := range want {
		exp[r.Name] = r.UID
	}
	gotUIDs := map[string]string{}
	for n, inst := range got {
		gotUIDs[n] = inst.UID
		wr := egressproxy.Ref{Name: n, UID: exp[n]}
		if _, ok := exp[n]; ok {
			for _, p := range instanceProblems(inst, wr, false) {
				e.t.Errorf("List entry %s: %s", n, p)
			}
		}
	}
	if d := cmp.Diff(exp, gotUIDs); d != "" {
		e.t.Errorf("List is not exact: name→UID (-want +got):\n%s", d)
	}
	return got
}

func (e *env) baseline() map[string]egressproxy.Instance {
	e.t.Helper()
	return e.byName(e.list())
}

// ---- Check ----

func testCheckReachable(e *env) {
	before := e.baseline()
	h, err := e.c.Check(e.ctx)
	if err != nil {
		e.fatalf("Check: %v", err)
	}
	if !h.Reachable || h.Reason != egressproxy.ReasonNone {
		e.t.Errorf("Check = Reachable %v Reason %q (%s), want reachable with no reason", h.Reachable, h.Reason, h.Message)
	}
	if h.CheckedAt.IsZero() {
		e.t.Error("Check: CheckedAt is zero")
	}
	// Values handed out are copies: mutating them changes nothing.
	saved := make(map[string]string, len(h.Details))
	for k, v := range h.Details {
		saved[k] = v
	}
	for k := range h.Details {
		h.Details[k] = "mutated by caller"
	}
	if h.Details != nil {
		h.Details["drivertest-injected"] = "x"
	}
	h2, err := e.p.Check(e.ctx)
	if err != nil {
		e.fatalf("Check (direct): %v", err)
	}
	if _, leaked := h2.Details["drivertest-injected"]; leaked {
		e.t.Error("Check hands out its own Details map: a caller's change shows in the next Check")
	}
	for k, v := range saved {
		if h2.Details[k] == "mutated by caller" {
			e.t.Errorf("Check Details[%q]: a caller's change shows in the next Check (was %q)", k, v)
		}
	}
	e.wantList(before) // Check creates nothing
}

// running counts the instances of l that run (Running or Provisioning):
// what Health.Capacity.Instances counts.
func running(l []egressproxy.Instance) int {
	n := 0
	for _, inst := range l {
		if inst.State == egressproxy.StateRunning || inst.State == egressproxy.StateProvisioning {
			n++
		}
	}
	return n
}

// checkCapacity runs Check and compares its Capacity, when the provider
// reports one, with the instances List returns; it reports whether there
// was one.
func (e *env) checkCapacity(what string) bool {
	e.t.Helper()
	h, err := e.c.Check(e.ctx)
	if err != nil {
		e.fatalf("%s: Check: %v", what, err)
	}
	c := h.Capacity
	if c == nil {
		return false
	}
	if !h.Reachable {
		e.t.Errorf("%s: Check reports a Capacity and not Reachable", what)
	}
	if c.MemoryAvailableBytes < 0 || c.CPUs < 1 || c.PoolAvailableBytes < 0 {
		e.t.Errorf("%s: Capacity %+v: want memory and pool space not negative and at least one CPU", what, *c)
	}
	if want := running(e.list()); c.Instances != want {
		e.t.Errorf("%s: Capacity.Instances = %d, want %d (List's Running and Provisioning instances)", what, c.Instances, want)
	}
	return true
}

// testCheckCapacity: a Capacity, when Check reports one, counts the
// instances that run, and follows a Create and a Delete.
func testCheckCapacity(e *env) {
	if !e.checkCapacity("before Create") {
		e.t.Log("Check reports no Capacity")
		return
	}
	s := e.spec("a")
	e.create(s)
	e.checkCapacity("after Create")
	if err := e.c.Delete(e.ctx, s.Ref()); err != nil {
		e.fatalf("Delete: %v", err)
	}
	e.checkCapacity("after Delete")
}

// ---- Create ----

func testCreateReturnsInstance(e *env) {
	before := e.baseline()
	s := e.spec("a")
	inst := e.create(s)
	if inst.State == egressproxy.StateFailed || inst.State == egressproxy.StateStopped {
		e.t.Errorf("Create returned an instance in state %s, want Provisioning or Running", inst.State)
	}
	e.wantList(before, s.Ref())
}

func testCreateIdempotent(e *env) {
	before := e.baseline()
	s := e.spec("a")
	first := e.create(s)
	second := e.create(s)
	third, err := e.p.Create(e.ctx, s) // directly, too
	if err != nil {
		e.fatalf("second Create directly on the provider: %v", err)
	}
	for i, again := range []egressproxy.Instance{second, third} {
		if again.UID != first.UID || !sameSecond(again.CreatedAt, first.CreatedAt) {
			e.t.Errorf("Create #%d of the same spec returned UID %q created %v, want the existing instance (UID %q created %v)",
				i+2, again.UID, again.CreatedAt, first.UID, first.CreatedAt)
		}
	}
	e.wantList(before, s.Ref())
}

func testCreateConcurrent(e *env) {
	before := e.baseline()
	s := e.spec("a")
	n := e.o.Concurrency
	insts := make([]egressproxy.Instance, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			insts[i], errs[i] = e.c.Create(e.ctx, s)
		}()
	}
	wg.Wait()
	ok := 0
	for i, err := range errs {
		switch {
		case err == nil:
			ok++
			if insts[i].UID != s.UID {
				e.t.Errorf("concurrent Create %d returned UID %q, want %q", i, insts[i].UID, s.UID)
			}
		case egressproxy.Code(err) == egressproxy.Transient:
			e.t.Logf("concurrent Create %d: transient (allowed): %v", i, err)
		default:
			e.t.Errorf("concurrent Create %d of one spec: %v (want success, or at worst Transient)", i, err)
		}
	}
	if ok == 0 {
		e.t.Error("no concurrent Create of one spec succeeded")
	}
	l := e.wantList(before, s.Ref())
	if got := e.get(s.Ref()); !sameSecond(got.CreatedAt, l[s.Name].CreatedAt) {
		e.t.Errorf("Get CreatedAt %v != List CreatedAt %v", got.CreatedAt, l[s.Name].CreatedAt)
	}
}

func testCreateNameTaken(e *env) {
	before := e.baseline()
	s := e.spec("a")
	orig := e.create(s)
	other := s
	other.UID = s.UID + "-other"
	e.remember(other.Ref())
	_, err := e.c.Create(e.ctx, other)
	e.wantCode("Create of a taken name with another UID (client)", err, egressproxy.Permanent)
	_, err = e.p.Create(e.ctx, other)
	e.wantCode("Create of a taken name with another UID (direct)", err, egressproxy.Permanent)
	got := e.get(s.Ref())
	if !sameSecond(got.CreatedAt, orig.CreatedAt) {
		e.t.Errorf("original instance changed: CreatedAt %v, was %v", got.CreatedAt, orig.CreatedAt)
	}
	_, err = e.c.Get(e.ctx, other.Ref())
	e.wantCode("Get of the rejected UID", err, egressproxy.NotFound)
	e.wantList(before, s.Ref())
}

func testCreateInvalidSpec(e *env) {
	before := e.baseline()
	tests := []struct {
		name   string
		field  string
		mutate func(*egressproxy.Spec)
	}{
		{"empty name", "Name", func(s *egressproxy.Spec) { s.Name = "" }},
		{"uppercase name", "Name", func(s *egressproxy.Spec) { s.Name = strings.ToUpper(s.Name) }},
		{"name with slash", "Name", func(s *egressproxy.Spec) { s.Name = s.Name + "/x" }},
		{"name too long", "Name", func(s *egressproxy.Spec) { s.Name = strings.Repeat("a", naming.MaxNameLen+1) }},
		{"empty UID", "UID", func(s *egressproxy.Spec) { s.UID = "" }},
		{"UID with control character", "UID", func(s *egressproxy.Spec) { s.UID = "a\nb" }},
		{"port out of range", "Port", func(s *egressproxy.Spec) { s.Port = 70000 }},
		{"negative port", "Port", func(s *egressproxy.Spec) { s.Port = -1 }},
		{"bad image key", "ImageKey", func(s *egressproxy.Spec) { s.ImageKey = "Not_A_Key" }},
		{"bad machine type", "MachineType", func(s *egressproxy.Spec) { s.MachineType = "a--b" }},
		{"user data too big", "UserData", func(s *egressproxy.Spec) { s.UserData = strings.Repeat("x", naming.MaxUserDataBytes+1) }},
	}
	var valid []egressproxy.Ref // bad specs whose Ref is valid: must not exist afterwards
	for _, tt := range tests {
		s := e.spec("bad")
		tt.mutate(&s)
		if naming.ValidateRef(s.Name, s.UID) == nil {
			valid = append(valid, s.Ref())
		}
		e.remember(s.Ref())
		for _, via := range []struct {
			name   string
			create func(context.Context, egressproxy.Spec) (egressproxy.Instance, error)
		}{{"client", e.c.Create}, {"provider", e.p.Create}} {
			_, err := via.create(e.ctx, s)
			if err == nil {
				e.t.Errorf("%s: Create (%s) accepted a bad spec", tt.name, via.name)
				continue
			}
			e.wantCode(tt.name+" ("+via.name+")", err, egressproxy.Permanent)
			if !strings.Contains(err.Error(), tt.field) {
				e.t.Errorf("%s: Create (%s) error %q does not name the field %s", tt.name, via.name, err, tt.field)
			}
		}
	}
	for _, r := range valid {
		_, err := e.c.Get(e.ctx, r)
		e.wantCode("Get after a rejected Create of "+r.Name, err, egressproxy.NotFound)
	}
	e.wantList(before)
}

func testCreateAfterDelete(e *env) {
	before := e.baseline()
	s := e.spec("a")
	e.create(s)
	if err := e.c.Delete(e.ctx, s.Ref()); err != nil {
		e.fatalf("Delete: %v", err)
	}
	s2 := s
	s2.UID = s.UID + "-second"
	e.remember(s2.Ref())
	inst := e.create(s2)
	if inst.UID != s2.UID {
		e.t.Errorf("Create after Delete returned UID %q, want %q", inst.UID, s2.UID)
	}
	_, err := e.c.Get(e.ctx, s.Ref())
	e.wantCode("Get of the deleted UID", err, egressproxy.NotFound)
	e.wantList(before, s2.Ref())
}

func testCreateSpecDigest(e *env) {
	s := e.spec("a")
	want := s.Digest()
	inst := e.create(s)
	if inst.SpecDigest != want {
		e.t.Errorf("Create returned SpecDigest %q, want Spec.Digest() %q", inst.SpecDigest, want)
	}
	if got := e.get(s.Ref()); got.SpecDigest != want {
		e.t.Errorf("Get returned SpecDigest %q, want %q", got.SpecDigest, want)
	}
	direct, err := e.p.Get(e.ctx, s.Ref())
	if err != nil {
		e.fatalf("Get (direct): %v", err)
	}
	if direct.SpecDigest != want {
		e.t.Errorf("direct Get returned SpecDigest %q, want %q", direct.SpecDigest, want)
	}
	if li, ok := e.byName(e.list())[s.Name]; !ok || li.SpecDigest != want {
		e.t.Errorf("List entry %+v: SpecDigest want %q", li, want)
	}
	again := e.create(s)
	if again.SpecDigest != want {
		e.t.Errorf("second Create returned SpecDigest %q, want %q", again.SpecDigest, want)
	}
}

func testCreateSpecConflict(e *env) {
	before := e.baseline()
	s := e.spec("a")
	orig := e.create(s)
	secret := "drivertest-secret-" + randomSuffix(12)
	type mutation struct {
		name   string
		mutate func(*egressproxy.Spec)
	}
	muts := []mutation{
		{"Port", func(o *egressproxy.Spec) { o.Port = s.EffectivePort()%65535 + 1 }},
		{"UserData", func(o *egressproxy.Spec) { o.UserData = "#cloud-config\n# " + secret + "\n" }},
	}
	if k := e.o.OtherImageKey; k != "" && k != s.ImageKey {
		muts = append(muts, mutation{"ImageKey", func(o *egressproxy.Spec) { o.ImageKey = k }})
	} else {
		e.t.Log("Options.OtherImageKey not set: a changed ImageKey is not checked")
	}
	if k := e.o.OtherMachineType; k != "" && k != s.MachineType {
		muts = append(muts, mutation{"MachineType", func(o *egressproxy.Spec) { o.MachineType = k }})
	} else {
		e.t.Log("Options.OtherMachineType not set: a changed MachineType is not checked")
	}
	for _, m := range muts {
		other := s
		m.mutate(&other)
		for _, via := range []struct {
			name   string
			create func(context.Context, egressproxy.Spec) (egressproxy.Instance, error)
		}{{"client", e.c.Create}, {"direct", e.p.Create}} {
			what := "Create of an existing UID with another " + m.name + " (" + via.name + ")"
			_, err := via.create(e.ctx, other)
			e.wantCode(what, err, egressproxy.Permanent)
			if !errors.Is(err, egressproxy.ErrSpecConflict) || !errors.Is(err, egressproxy.ErrPermanent) {
				e.t.Errorf("%s: %v; want errors.Is ErrSpecConflict and ErrPermanent", what, err)
			}
			if err != nil && strings.Contains(err.Error(), secret) {
				e.t.Errorf("%s: the error shows the user-data: %v", what, err)
			}
		}
	}
	// Port 0 means DefaultPort: the same spec, not a conflict.
	same := s
	switch s.Port {
	case 0:
		same.Port = naming.DefaultPort
	case naming.DefaultPort:
		same.Port = 0
	}
	if again := e.create(same); !sameSecond(again.CreatedAt, orig.CreatedAt) {
		e.t.Errorf("Create with Port %d for %d returned a new instance (created %v, was %v)", same.Port, s.Port, again.CreatedAt, orig.CreatedAt)
	}
	got := e.get(s.Ref())
	if !sameSecond(got.CreatedAt, orig.CreatedAt) || got.SpecDigest != s.Digest() || got.Port != orig.Port {
		e.t.Errorf("the conflicting Creates changed the instance: %+v, was %+v (digest %s)", got, orig, s.Digest())
	}
	e.wantList(before, s.Ref())
}

// ---- Get ----

func testGetReadsBack(e *env) {
	s := e.spec("a")
	created := e.create(s)
	g1 := e.get(s.Ref())
	g2 := e.get(s.Ref())
	if !g1.CreatedAt.Equal(g2.CreatedAt) {
		e.t.Errorf("CreatedAt not stable across reads: %v then %v", g1.CreatedAt, g2.CreatedAt)
	}
	if !sameSecond(created.CreatedAt, g1.CreatedAt) {
		e.t.Errorf("Create returned CreatedAt %v, Get reads back %v", created.CreatedAt, g1.CreatedAt)
	}
	direct, err := e.p.Get(e.ctx, s.Ref())
	if err != nil {
		e.fatalf("Get (direct): %v", err)
	}
	if direct.UID != s.UID || !direct.CreatedAt.Equal(g1.CreatedAt) {
		e.t.Errorf("direct Get = %+v, client Get = %+v", direct, g1)
	}
	l := e.byName(e.list())
	if li, ok := l[s.Name]; !ok || li.UID != s.UID || !li.CreatedAt.Equal(g1.CreatedAt) {
		e.t.Errorf("List entry %+v does not match Get %+v", li, g1)
	}
}

func testGetMissing(e *env) {
	s := e.spec("never-created")
	_, err := e.c.Get(e.ctx, s.Ref())
	e.wantCode("Get of a missing instance (client)", err, egressproxy.NotFound)
	if !errors.Is(err, egressproxy.ErrNotFound) {
		e.t.Errorf("errors.Is(%v, ErrNotFound) = false", err)
	}
	_, err = e.p.Get(e.ctx, s.Ref())
	e.wantCode("Get of a missing instance (direct)", err, egressproxy.NotFound)
}

func testGetWrongUID(e *env) {
	s := e.spec("a")
	e.create(s)
	wrong := egressproxy.Ref{Name: s.Name, UID: s.UID + "-wrong"}
	_, err := e.c.Get(e.ctx, wrong)
	e.wantCode("Get with the right name and a wrong UID (client)", err, egressproxy.NotFound)
	_, err = e.p.Get(e.ctx, wrong)
	e.wantCode("Get with the right name and a wrong UID (direct)", err, egressproxy.NotFound)
}

func testGetInvalidRef(e *env) {
	for _, r := range []egressproxy.Ref{{Name: "Bad_Name", UID: "u"}, {Name: e.prefix + "-a", UID: ""}} {
		_, err := e.p.Get(e.ctx, r)
		e.wantCode("Get (direct) of invalid ref "+strconv.Quote(r.Name), err, egressproxy.Permanent)
		_, err = e.c.Get(e.ctx, r)
		e.wantCode("Get (client) of invalid ref "+strconv.Quote(r.Name), err, egressproxy.Permanent)
	}
}

// ---- Delete ----

func testDeleteRemoves(e *env) {
	before := e.baseline()
	a, b := e.spec("a"), e.spec("b")
	e.create(a)
	e.create(b)
	if err := e.c.Delete(e.ctx, a.Ref()); err != nil {
		e.fatalf("Delete: %v", err)
	}
	_, err := e.c.Get(e.ctx, a.Ref())
	e.wantCode("Get after Delete", err, egressproxy.NotFound)
	e.get(b.Ref()) // the other one is untouched
	e.wantList(before, b.Ref())
}

func testDeleteMissing(e *env) {
	s := e.spec("never-created")
	if err := e.c.Delete(e.ctx, s.Ref()); err != nil {
		e.t.Errorf("Delete of a missing instance (client) = %v, want nil", err)
	}
	if err := e.p.Delete(e.ctx, s.Ref()); err != nil {
		e.t.Errorf("Delete of a missing instance (direct) = %v, want nil", err)
	}
	d := e.spec("deleted-twice")
	e.create(d)
	for i := 1; i <= 2; i++ {
		if err := e.c.Delete(e.ctx, d.Ref()); err != nil {
			e.t.Errorf("Delete #%d of one instance = %v, want nil", i, err)
		}
	}
}

// testDeleteStorageGone: with the entry's storage taken away (for kvm2: its
// pool destroyed and undefined), Delete can neither succeed for an existing
// instance (its volumes cannot be reached) nor say NotFound (the contract
// forbids NotFound for Delete); it fails with a class a caller can act on.
// Once the storage is back, Delete completes and the instance is gone.
func testDeleteStorageGone(e *env) {
	sh, ok := e.h.(StorageHarness)
	if !ok {
		e.t.Skip("the harness does not implement drivertest.StorageHarness: Delete without storage is not checked")
	}
	s := e.spec("storage-gone")
	e.create(s)
	never := e.spec("storage-gone-never-created")
	if err := sh.RemoveStorage(e.ctx); err != nil {
		e.fatalf("RemoveStorage: %v", err)
	}
	restored := false
	defer func() {
		if !restored {
			ctx, cancel := context.WithTimeout(context.Background(), e.o.Grace+time.Minute)
			defer cancel()
			if err := sh.RestoreStorage(ctx); err != nil {
				e.t.Errorf("RestoreStorage: %v", err)
			}
		}
	}()
	err := e.c.Delete(e.ctx, s.Ref())
	switch c := egressproxy.Code(err); {
	case err == nil:
		e.t.Errorf("Delete of an instance whose storage is gone = nil, want an error (its volumes cannot have been deleted)")
	case c != egressproxy.Permanent && c != egressproxy.Transient:
		e.t.Errorf("Delete of an instance whose storage is gone = %v (%v), want Permanent or Transient", err, c)
	}
	if err := e.c.Delete(e.ctx, never.Ref()); err != nil {
		if c := egressproxy.Code(err); c != egressproxy.Permanent && c != egressproxy.Transient {
			e.t.Errorf("Delete of a missing instance while the storage is gone = %v (%v), want nil, Permanent or Transient", err, c)
		}
	}
	if err := sh.RestoreStorage(e.ctx); err != nil {
		e.fatalf("RestoreStorage: %v", err)
	}
	restored = true
	if err := e.c.Delete(e.ctx, s.Ref()); err != nil {
		e.t.Errorf("Delete once the storage is back = %v, want nil", err)
	}
	_, err = e.c.Get(e.ctx, s.Ref())
	e.wantCode("Get after Delete once the storage is back", err, egressproxy.NotFound)
	if err := e.c.Delete(e.ctx, never.Ref()); err != nil {
		e.t.Errorf("Delete of a missing instance once the storage is back = %v, want nil", err)
	}
}

func testDeleteWrongUID(e *env) {
	before := e.baseline()
	s := e.spec("a")
	orig := e.create(s)
	wrong := egressproxy.Ref{Name: s.Name, UID: s.UID + "-wrong"}
	if err := e.c.Delete(e.ctx, wrong); err != nil {
		e.t.Errorf("Delete with a wrong UID = %v, want nil (treated as missing)", err)
	}
	if err := e.p.Delete(e.ctx, wrong); err != nil {
		e.t.Errorf("Delete (direct) with a wrong UID = %v, want nil (treated as missing)", err)
	}
	got := e.get(s.Ref())
	if !sameSecond(got.CreatedAt, orig.CreatedAt) {
		e.t.Errorf("instance changed after a Delete with a wrong UID: CreatedAt %v, was %v", got.CreatedAt, orig.CreatedAt)
	}
	e.wantList(before, s.Ref())
}

// ---- List ----

func testListExact(e *env) {
	before := e.baseline()
	a, b, c := e.spec("a"), e.spec("b"), e.spec("c")
	for _, s := range []egressproxy.Spec{a, b, c} {
		e.create(s)
	}
	l := e.wantList(before, a.Ref(), b.Ref(), c.Ref())
	for _, s := range []egressproxy.Spec{a, b, c} {
		g := e.get(s.Ref())
		if !g.CreatedAt.Equal(l[s.Name].CreatedAt) {
			e.t.Errorf("List CreatedAt of %s = %v, Get reads %v", s.Name, l[s.Name].CreatedAt, g.CreatedAt)
		}
	}
	if err := e.c.Delete(e.ctx, b.Ref()); err != nil {
		e.fatalf("Delete: %v", err)
	}
	e.wantList(before, a.Ref(), c.Ref())
}

func testOtherEntryInvisible(e *env) {
	oh, ok := e.h.(OtherEntryHarness)
	if !ok {
		e.t.Skip("the harness does not implement drivertest.OtherEntryHarness: isolation between entries is not checked")
	}
	op, err := oh.MakeOtherEntryProvider(e.ctx)
	if err != nil {
		e.fatalf("MakeOtherEntryProvider: %v", err)
	}
	other := driver.NewClient(op, nil)
	defer other.Close()
	before := e.baseline()
	otherBefore, err := other.List(e.ctx)
	if err != nil {
		e.fatalf("List on the other entry: %v", err)
	}
	mine, theirs := e.spec("mine"), e.spec("theirs")
	e.create(mine)
	if _, err := other.Create(e.ctx, theirs); err != nil {
		e.fatalf("Create on the other entry: %v", err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), e.o.Grace+time.Minute)
		defer cancel()
		if err := op.Delete(ctx, theirs.Ref()); err != nil {
			e.t.Errorf("cleanup on the other entry: %v", err)
		}
	}()
	// Neither reads the other's instance...
	_, err = e.c.Get(e.ctx, theirs.Ref())
	e.wantCode("Get of the other entry's instance", err, egressproxy.NotFound)
	_, err = other.Get(e.ctx, mine.Ref())
	e.wantCode("the other entry's Get of this entry's instance", err, egressproxy.NotFound)
	// ...nor deletes it...
	if err := other.Delete(e.ctx, mine.Ref()); err != nil {
		e.t.Errorf("the other entry's Delete of this entry's instance = %v, want nil (missing there)", err)
	}
	e.get(mine.Ref())
	// ...nor lists it.
	e.wantList(before, mine.Ref())
	l, err := other.List(e.ctx)
	if err != nil {
		e.fatalf("List on the other entry: %v", err)
	}
	got := map[string]string{}
	for _, inst := range l {
		got[inst.Name] = inst.UID
	}
	want := map[string]string{theirs.Name: theirs.UID}
	for _, inst := range otherBefore {
		want[inst.Name] = inst.UID
	}
	if d := cmp.Diff(want, got); d != "" {
		e.t.Errorf("the other entry's List is not exact (-want +got):\n%s", d)
	}
}

// ---- State ----

func testReachesRunning(e *env) {
	s := e.spec("a")
	inst := e.create(s)
	deadline := time.Now().Add(e.o.RunningTimeout)
	seen := []egressproxy.State{inst.State}
	polls := 0
	for inst.State != egressproxy.StateRunning {
		if inst.State != egressproxy.StateProvisioning {
			e.fatalf("instance went %v on its way to Running (states seen: %v)", inst.State, seen)
		}
		if e.o.NeverRunning && polls >= 3 {
			return // Provisioning, as declared; its shape was checked on every read
		}
		if time.Now().After(deadline) {
			e.fatalf("instance not Running after %v (Options.RunningTimeout); states seen: %v", e.o.RunningTimeout, seen)
		}
		select {
		case <-e.ctx.Done():
			e.fatalf("waiting for Running: %v", e.ctx.Err())
		case <-time.After(e.o.PollInterval):
		}
		inst = e.get(s.Ref())
		polls++
		if seen[len(seen)-1] != inst.State {
			seen = append(seen, inst.State)
		}
	}
	if inst.IP == "" || inst.Address() == "" {
		e.t.Errorf("Running instance has no address: %+v", inst)
	}
	// Running stays Running on the next read, with the same address.
	again := e.get(s.Ref())
	if again.State != egressproxy.StateRunning || again.Address() != inst.Address() {
		e.t.Errorf("second read of a Running instance: state %v address %q, was Running at %q", again.State, again.Address(), inst.Address())
	}
}

// ---- Context ----

type call struct {
	name string
	do   func(context.Context) error
}

func (e *env) calls(p driver.Provider, s egressproxy.Spec) []call {
	return []call{
		{"Create", func(ctx context.Context) error { _, err := p.Create(ctx, s); return err }},
		{"Get", func(ctx context.Context) error { _, err := p.Get(ctx, s.Ref()); return err }},
		{"Delete", func(ctx context.Context) error { return p.Delete(ctx, s.Ref()) }},
		{"List", func(ctx context.Context) error { _, err := p.List(ctx); return err }},
		{"Check", func(ctx context.Context) error { _, err := p.Check(ctx); return err }},
	}
}

func testContextCanceled(e *env) {
	before := e.baseline()
	s := e.spec("a")
	ctx, cancel := context.WithCancel(e.ctx)
	cancel()
	for _, c := range e.calls(e.p, s) {
		err := c.do(ctx)
		e.wantCode(c.name+" with a cancelled context (direct)", err, egressproxy.Canceled)
		if err != nil && !errors.Is(err, context.Canceled) {
			e.t.Errorf("%s with a cancelled context: errors.Is(err, context.Canceled) = false (%v)", c.name, err)
		}
	}
	_, err := e.c.Create(ctx, s)
	e.wantCode("Create with a cancelled context (client)", err, egressproxy.Canceled)
	_, err = e.c.Get(e.ctx, s.Ref())
	e.wantCode("Get after Creates with a cancelled context", err, egressproxy.NotFound)
	e.wantList(before)
}

func testContextDeadline(e *env) {
	before := e.baseline()
	s := e.spec("a")
	ctx, cancel := context.WithDeadline(e.ctx, time.Now().Add(-time.Second))
	defer cancel()
	for _, c := range e.calls(e.p, s) {
		err := c.do(ctx)
		e.wantCode(c.name+" with an expired deadline (direct)", err, egressproxy.DeadlineExceeded)
	}
	e.wantList(before)
}

// ---- Close ----

func testCallsAfterClose(e *env) {
	s := e.spec("a")
	if err := e.p.Close(); err != nil {
		e.t.Errorf("Close: %v", err)
	}
	for _, c := range e.calls(e.p, s) {
		err := c.do(e.ctx)
		if !errors.Is(err, egressproxy.ErrClosed) {
			e.t.Errorf("%s after Close = %v, want an error wrapping egressproxy.ErrClosed", c.name, err)
		}
		e.wantCode(c.name+" after Close", err, egressproxy.Permanent)
	}
	// Through the client (which closes the provider again: idempotent).
	if err := e.c.Close(); err != nil {
		e.t.Errorf("Client.Close after the provider's Close: %v", err)
	}
	_, err := e.c.Get(e.ctx, s.Ref())
	if !errors.Is(err, egressproxy.ErrClosed) {
		e.t.Errorf("client Get after Close = %v, want ErrClosed", err)
	}
}

func testCloseIdempotent(e *env) {
	first := e.p.Close()
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i] = e.p.Close() }()
	}
	wg.Wait()
	for i, err := range errs {
		if first == nil && err != nil {
			e.t.Errorf("Close #%d after a successful Close = %v, want nil", i+2, err)
		}
	}
	if err := e.c.Close(); err != nil && first == nil {
		e.t.Errorf("Client.Close = %v", err)
	}
	if err := e.c.Close(); err != nil && first == nil {
		e.t.Errorf("second Client.Close = %v", err)
	}
}

// ---- Client ----

func testClientErrors(e *env) {
	s := e.spec("never-created")
	_, err := e.c.Get(e.ctx, s.Ref())
	var op *egressproxy.OpError
	if !errors.As(err, &op) {
		e.fatalf("client Get error %v (%T) is not an *egressproxy.OpError", err, err)
	}
	if op.Op != "get" || op.Instance != s.Name {
		e.t.Errorf("OpError{Op: %q, Instance: %q}, want get and %q", op.Op, op.Instance, s.Name)
	}
	if !strings.Contains(err.Error(), s.Name) {
		e.t.Errorf("error %q does not name the instance", err)
	}
}
