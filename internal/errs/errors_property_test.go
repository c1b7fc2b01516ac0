package errs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

// errTree is a randomly built error together with a model of the classes it
// must carry: the classed nodes of its tree that are not hidden behind a
// WithCode, in the order errors.Is visits them. The model is computed from
// how the tree was built, not by asking the package.
type errTree struct {
	err     error
	classes []ErrorCode // visible class nodes, traversal order
	ctx     []ErrorCode // context errors in the tree (Canceled, DeadlineExceeded)
	desc    string
}

// classSentinels maps each class to its sentinel.
var classSentinels = map[ErrorCode]error{Transient: ErrTransient, Permanent: ErrPermanent, NotFound: ErrNotFound}

// sentinelLeaves are the exported error variables with the class each must
// carry.
var sentinelLeaves = []struct {
	name string
	err  error
	code ErrorCode
}{
	{"ErrTransient", ErrTransient, Transient},
	{"ErrPermanent", ErrPermanent, Permanent},
	{"ErrNotFound", ErrNotFound, NotFound},
	{"ErrClosed", ErrClosed, Permanent},
	{"ErrSpecConflict", ErrSpecConflict, Permanent},
}

// anyCode draws a code, including the ones WithCode must normalise (OK, out
// of range) to Unknown.
func anyCode(t *rapid.T, label string) ErrorCode {
	return rapid.SampledFrom([]ErrorCode{OK, Unknown, Transient, Permanent, NotFound, Canceled, DeadlineExceeded, 99}).Draw(t, label)
}

func normCode(c ErrorCode) ErrorCode {
	if c <= OK || c > DeadlineExceeded {
		return Unknown
	}
	return c
}

func genLeaf(t *rapid.T) errTree {
	switch rapid.IntRange(0, 8).Draw(t, "leaf") {
	case 0:
		return errTree{err: io.EOF, desc: "EOF"}
	case 1:
		s := rapid.SampledFrom(sentinelLeaves).Draw(t, "sentinel")
		return errTree{err: s.err, classes: []ErrorCode{s.code}, desc: s.name}
	case 2:
		return errTree{err: context.Canceled, ctx: []ErrorCode{Canceled}, desc: "Canceled"}
	case 3:
		return errTree{err: context.DeadlineExceeded, ctx: []ErrorCode{DeadlineExceeded}, desc: "DeadlineExceeded"}
	case 4:
		return errTree{err: &FieldError{Field: "Name", Value: "A", Rule: "lowercase"}, desc: "FieldError"}
	case 5:
		return errTree{err: &net.DNSError{Err: "timeout", Name: "h", IsTimeout: true}, desc: "DNSError"}
	case 6:
		// FromContext of a context error.
		if rapid.Bool().Draw(t, "deadline") {
			return errTree{err: FromContext(context.DeadlineExceeded), classes: []ErrorCode{DeadlineExceeded}, ctx: []ErrorCode{DeadlineExceeded}, desc: "FromContext(DeadlineExceeded)"}
		}
		return errTree{err: FromContext(context.Canceled), classes: []ErrorCode{Canceled}, ctx: []ErrorCode{Canceled}, desc: "FromContext(Canceled)"}
	case 7:
		// context.Cause of a context canceled with a cause that is not a
		// context error.
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(io.ErrUnexpectedEOF)
		return errTree{err: context.Cause(ctx), desc: "Cause(UnexpectedEOF)"}
	default:
		return errTree{err: errors.New("plain"), desc: "plain"}
	}
}

func genTree(t *rapid.T, depth int) errTree {
	if depth <= 0 || rapid.IntRange(0, 3).Draw(t, "stop") == 0 {
		return genLeaf(t)
	}
	kids := func(n int) []errTree {
		out := make([]errTree, n)
		for i := range out {
			out[i] = genTree(t, depth-1)
		}
		return out
	}
	concat := func(ts []errTree) ([]ErrorCode, []ErrorCode, []error, []string) {
		var cls, ctx []ErrorCode
		var errs []error
		var descs []string
		for _, k := range ts {
			cls = append(cls, k.classes...)
			ctx = append(ctx, k.ctx...)
			errs = append(errs, k.err)
			descs = append(descs, k.desc)
		}
		return cls, ctx, errs, descs
	}
	switch rapid.IntRange(0, 8).Draw(t, "node") {
	case 0: // fmt.Errorf, one %w
		k := genTree(t, depth-1)
		return errTree{err: fmt.Errorf("op: %w", k.err), classes: k.classes, ctx: k.ctx, desc: "wrap(" + k.desc + ")"}
	case 1: // fmt.Errorf, several %w
		ks := kids(rapid.IntRange(2, 3).Draw(t, "n"))
		cls, ctx, errs, descs := concat(ks)
		args := make([]any, len(errs))
		verbs := make([]string, len(errs))
		for i, e := range errs {
			args[i], verbs[i] = e, "%w"
		}
		return errTree{err: fmt.Errorf(strings.Join(verbs, ", "), args...), classes: cls, ctx: ctx, desc: "wrapN(" + strings.Join(descs, ", ") + ")"}
	case 2: // errors.Join
		ks := kids(rapid.IntRange(1, 3).Draw(t, "n"))
		cls, ctx, errs, descs := concat(ks)
		return errTree{err: errors.Join(errs...), classes: cls, ctx: ctx, desc: "join(" + strings.Join(descs, ", ") + ")"}
	case 3: // *Error literal: its class, then whatever it wraps (not hidden)
		c := anyCode(t, "litcode")
		k := genTree(t, depth-1)
		return errTree{err: &Error{Code: c, Err: k.err}, classes: append([]ErrorCode{normCode(c)}, k.classes...), ctx: k.ctx, desc: fmt.Sprintf("&Error{%v, %s}", c, k.desc)}
	case 4: // WithCode: one class, whatever is inside
		c := anyCode(t, "code")
		k := genTree(t, depth-1)
		return errTree{err: WithCode(c, k.err), classes: []ErrorCode{normCode(c)}, ctx: k.ctx, desc: fmt.Sprintf("WithCode(%v, %s)", c, k.desc)}
	case 5: // Errorf
		c := anyCode(t, "code")
		k := genTree(t, depth-1)
		return errTree{err: Errorf(c, "step: %w", k.err), classes: []ErrorCode{normCode(c)}, ctx: k.ctx, desc: fmt.Sprintf("Errorf(%v, %s)", c, k.desc)}
	case 6: // *net.OpError
		k := genTree(t, depth-1)
		return errTree{err: &net.OpError{Op: "dial", Net: "tcp", Err: k.err}, classes: k.classes, ctx: k.ctx, desc: "OpError(" + k.desc + ")"}
	case 7: // a cause joined to a context error, as context.Cause users do
		k := genTree(t, depth-1)
		return errTree{err: fmt.Errorf("%w: %w", context.Canceled, k.err), classes: k.classes, ctx: append([]ErrorCode{Canceled}, k.ctx...), desc: "cause(" + k.desc + ")"}
	default: // WithCode of the same class twice
		c := anyCode(t, "code")
		k := genTree(t, depth-1)
		return errTree{err: WithCode(c, WithCode(c, k.err)), classes: []ErrorCode{normCode(c)}, ctx: k.ctx, desc: fmt.Sprintf("WithCode²(%v, %s)", c, k.desc)}
	}
}

func has(cs []ErrorCode, c ErrorCode) bool {
	for _, x := range cs {
		if x == c {
			return true
		}
	}
	return false
}

// TestPropertyOneClass: Code and errors.Is agree on every error built from
// the package's constructors, the sentinels, context, net and fmt errors.
func TestPropertyOneClass(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		tr := genTree(t, 4)
		err := tr.err
		got := Code(err)
		var want ErrorCode
		switch {
		case len(tr.classes) > 0:
			// (a), (b), (d): the first visible class in traversal order.
			want = tr.classes[0]
		case has(tr.ctx, Canceled):
			want = Canceled
		case has(tr.ctx, DeadlineExceeded):
			want = DeadlineExceeded
		default:
			want = Unknown
		}
		if got != want {
			t.Fatalf("%s: Code = %v, want %v (classes %v)", tr.desc, got, want, tr.classes)
		}
		if s, ok := classSentinels[got]; ok && !errors.Is(err, s) {
			t.Fatalf("%s: Code = %v but errors.Is(err, %v) is false", tr.desc, got, s)
		}
		switch got {
		case Canceled:
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("%s: Code = Canceled but errors.Is(err, context.Canceled) is false", tr.desc)
			}
		case DeadlineExceeded:
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("%s: Code = DeadlineExceeded but errors.Is(err, context.DeadlineExceeded) is false", tr.desc)
			}
		}
		for c, s := range classSentinels {
			is := errors.Is(err, s)
			switch {
			case len(tr.classes) <= 1 && is != (c == got):
				// (a), (c): exactly the one class (or none) matches.
				t.Fatalf("%s: one class %v, but errors.Is(err, %v) = %v", tr.desc, tr.classes, s, is)
			case len(tr.classes) > 1 && is != has(tr.classes, c):
				t.Fatalf("%s: classes %v, but errors.Is(err, %v) = %v", tr.desc, tr.classes, s, is)
			}
		}
		// (b) WithCode(c, anything) has exactly that one class.
		c := anyCode(t, "outer")
		w := WithCode(c, err)
		if Code(w) != normCode(c) {
			t.Fatalf("WithCode(%v, %s): Code = %v", c, tr.desc, Code(w))
		}
		for sc, s := range classSentinels {
			if errors.Is(w, s) != (sc == normCode(c)) {
				t.Fatalf("WithCode(%v, %s): errors.Is(%v) = %v", c, tr.desc, s, errors.Is(w, s))
			}
		}
		// Identity sentinels stay visible through any wrapping.
		for _, id := range []error{ErrClosed, ErrSpecConflict, io.EOF, context.Canceled} {
			if errors.Is(err, id) && !errors.Is(w, id) {
				t.Fatalf("WithCode(%v, %s) hides %v", c, tr.desc, id)
			}
		}
	})
}

// TestSentinelsClassed: every exported error variable of the package has
// the class its doc gives it, and Code agrees with errors.Is for it.
func TestSentinelsClassed(t *testing.T) {
	for _, s := range sentinelLeaves {
		for _, err := range []error{s.err, fmt.Errorf("x: %w", s.err), errors.Join(io.EOF, s.err)} {
			if Code(err) != s.code {
				t.Errorf("Code(%v) = %v, want %v", err, Code(err), s.code)
			}
			for c, cs := range classSentinels {
				if errors.Is(err, cs) != (c == s.code) {
					t.Errorf("errors.Is(%v, %v) = %v", err, cs, !(c == s.code))
				}
			}
			if !errors.Is(err, s.err) {
				t.Errorf("errors.Is(%v, %s) = false", err, s.name)
			}
		}
	}
	if errors.Is(ErrClosed, ErrSpecConflict) || errors.Is(ErrSpecConflict, ErrClosed) || errors.Is(ErrPermanent, ErrClosed) {
		t.Error("identity sentinels match one another")
	}
	if errors.Is(WithCode(Permanent, io.EOF), ErrClosed) {
		t.Error("a Permanent error matches ErrClosed")
	}
}
