package libvirterr

import (
	"context"
	"errors"
	"fmt"
	"io"
	"syscall"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/budget"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
)

// maxNumber is the highest libvirt error number go-libvirt defines
// (ErrAgentCommandFailed); the table test covers every number up to it and
// one beyond.
const maxNumber = libvirt.ErrAgentCommandFailed

func lvErr(n libvirt.ErrorNumber, msg string) error {
	if msg == "" {
		msg = fmt.Sprintf("libvirt error %d", n)
	}
	return libvirt.Error{Code: uint32(n), Message: msg}
}

// want is the class and reason of every libvirt number, written out apart
// from Table so that a change to either is seen.
func want(n libvirt.ErrorNumber) (errs.ErrorCode, egressproxy.HealthReason) {
	switch n {
	case libvirt.ErrNoDomain, libvirt.ErrNoStorageVol, libvirt.ErrNoDomainMetadata:
		return errs.NotFound, egressproxy.ReasonUnknown
	case libvirt.ErrNoStoragePool:
		return errs.Permanent, egressproxy.ReasonPoolNotFound
	case libvirt.ErrAccessDenied, libvirt.ErrAuthFailed, libvirt.ErrAuthUnavailable, libvirt.ErrAuthCancelled, libvirt.ErrOperationDenied:
		return errs.Permanent, egressproxy.ReasonForbidden
	case libvirt.ErrInvalidArg, libvirt.ErrNoSupport, libvirt.ErrOperationInvalid, libvirt.ErrOperationUnsupported,
		libvirt.ErrArgumentUnsupported, libvirt.ErrConfigUnsupported, libvirt.ErrXMLError, libvirt.ErrXMLDetail,
		libvirt.ErrXMLInvalidSchema, libvirt.ErrDomExist, libvirt.ErrStorageVolExist, libvirt.ErrInvalidStoragePool,
		libvirt.ErrInvalidStorageVol, libvirt.ErrInvalidDomain, libvirt.ErrNoNetwork, libvirt.ErrInvalidMac,
		libvirt.ErrCPUIncompatible, libvirt.ErrNoKernel:
		return errs.Permanent, egressproxy.ReasonUnknown
	case libvirt.ErrNoConnect, libvirt.ErrInvalidConn, libvirt.ErrRPC:
		return errs.Transient, egressproxy.ReasonUnreachable
	}
	return errs.Transient, egressproxy.ReasonUnknown
}

// TestEveryLibvirtNumber checks the verdict of every libvirt error number,
// bare and wrapped, through Classify, ClassifyRead and Reason.
func TestEveryLibvirtNumber(t *testing.T) {
	t.Parallel()
	for n := libvirt.ErrOk; n <= maxNumber+1; n++ {
		code, reason := want(n)
		for _, err := range []error{lvErr(n, ""), fmt.Errorf("look up: %w", lvErr(n, "")), &libvirt.Error{Code: uint32(n), Message: "pointer"}} {
			v := Of(err)
			if v.Code != code || v.Reason != reason || v.Missing != (code == errs.NotFound) {
				t.Errorf("Of(%d %v) = %+v, want %v %v", n, err, v, code, reason)
			}
			got := Classify(err)
			if c := errs.Code(got); c != code {
				t.Errorf("Classify(%d) = %v, want %v", n, c, code)
			}
			if !errors.Is(got, err) {
				t.Errorf("Classify(%d) lost its cause", n)
			}
			// A denial of the entry's rights or a missing pool is the
			// entry's fault: Permanent on reads too. Any other Permanent
			// answer is about the object read: Transient on a read.
			entry := reason != egressproxy.ReasonUnknown
			if v.Entry != entry {
				t.Errorf("Of(%d).Entry = %v, want %v", n, v.Entry, entry)
			}
			wantRead := code
			if code == errs.Permanent && !entry {
				wantRead = errs.Transient
			}
			if c := errs.Code(ClassifyRead(err)); c != wantRead {
				t.Errorf("ClassifyRead(%d) = %v, want %v", n, c, wantRead)
			}
			if r := Reason(err); r != reason {
				t.Errorf("Reason(%d) = %q, want %q", n, r, reason)
			}
		}
	}
	for n := range Table {
		if n > maxNumber {
			t.Errorf("Table lists %d, beyond the numbers this test covers", n)
		}
	}
}

func sshErr(k sshconn.Kind, inner error) error {
	return &sshconn.Error{Kind: k, Address: "127.0.0.1:22", Op: "test", Err: inner}
}

func TestShapes(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		err    error
		code   errs.ErrorCode
		reason egressproxy.HealthReason
		read   errs.ErrorCode // ClassifyRead; zero: same as code
	}{
		{"nil", nil, errs.OK, egressproxy.ReasonNone, 0},
		{"explicit class wins", errs.WithCode(errs.Transient, lvErr(libvirt.ErrNoDomain, "")), errs.Transient, egressproxy.ReasonUnknown, 0},
		{"explicit class keeps the reason of its cause", errs.WithCode(errs.Permanent, sshErr(sshconn.KindAuthRefused, nil)), errs.Permanent, egressproxy.ReasonUnauthorized, errs.Permanent},
		{"canceled", fmt.Errorf("call: %w", context.Canceled), errs.Canceled, egressproxy.ReasonUnknown, 0},
		{"deadline inside unreachable", sshErr(sshconn.KindUnreachable, context.DeadlineExceeded), errs.DeadlineExceeded, egressproxy.ReasonUnknown, 0},
		{"our DialTimeout inside unreachable", sshErr(sshconn.KindUnreachable, fmt.Errorf("%w (i/o timeout)", &budget.TimeoutError{Budget: "DialTimeout", After: time.Second})), errs.Transient, egressproxy.ReasonUnreachable, 0},
		{"our CallTimeout bare", fmt.Errorf("step: %w", &budget.TimeoutError{Budget: "CallTimeout", After: time.Second}), errs.Transient, egressproxy.ReasonUnreachable, 0},
		{"unreachable wraps access denied", sshErr(sshconn.KindUnreachable, lvErr(libvirt.ErrAccessDenied, "")), errs.Transient, egressproxy.ReasonUnreachable, 0},
		{"ssh closed", sshErr(sshconn.KindClosed, nil), errs.Permanent, egressproxy.ReasonUnknown, errs.Permanent},
		{"ssh config", sshErr(sshconn.KindConfig, nil), errs.Permanent, egressproxy.ReasonUnknown, 0},
		{"key unreadable", sshErr(sshconn.KindKeyUnreadable, nil), errs.Permanent, egressproxy.ReasonCredentialsUnavailable, 0},
		{"auth refused", sshErr(sshconn.KindAuthRefused, nil), errs.Permanent, egressproxy.ReasonUnauthorized, 0},
		{"host unknown", sshErr(sshconn.KindHostUnknown, nil), errs.Permanent, egressproxy.ReasonHostKeyUnknown, 0},
		{"host key mismatch", sshErr(sshconn.KindHostKeyMismatch, nil), errs.Permanent, egressproxy.ReasonHostKeyMismatch, 0},
		{"socket forbidden", sshErr(sshconn.KindForbidden, nil), errs.Transient, egressproxy.ReasonForbidden, 0},
		{"EINVAL after disconnect", fmt.Errorf("state: %w", syscall.EINVAL), errs.Transient, egressproxy.ReasonUnreachable, 0},
		{"interrupted", libvirt.ErrInterrupted, errs.Transient, egressproxy.ReasonUnreachable, 0},
		{"eof", io.EOF, errs.Transient, egressproxy.ReasonUnreachable, 0},
		{"pool marker", fmt.Errorf("pool %q is inactive: %w", "p", ErrPoolInactive), errs.Permanent, egressproxy.ReasonPoolNotActive, 0},
		{"libvirt pool not active", lvErr(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool 'p' is not active"), errs.Permanent, egressproxy.ReasonPoolNotActive, 0},
		{"pool busy", lvErr(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool 'p' has asynchronous jobs running."), errs.Transient, egressproxy.ReasonUnknown, 0},
		{"procedure unsupported", libvirt.ErrUnsupported, errs.Permanent, egressproxy.ReasonUnknown, errs.Transient},
		{"plain", errors.New("odd"), errs.Transient, egressproxy.ReasonUnknown, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if c := errs.Code(Classify(tt.err)); c != tt.code {
				t.Errorf("Classify = %v, want %v", c, tt.code)
			}
			read := tt.read
			if read == 0 {
				read = tt.code
			}
			if c := errs.Code(ClassifyRead(tt.err)); c != read {
				t.Errorf("ClassifyRead = %v, want %v", c, read)
			}
			if r := Reason(tt.err); r != tt.reason {
				t.Errorf("Reason = %q, want %q", r, tt.reason)
			}
		})
	}
}

func TestPoolBusy(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{lvErr(libvirt.ErrInternalError, "internal error: pool 'p' has asynchronous jobs running."), true},
		{fmt.Errorf("refresh: %w", lvErr(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool 'p' has asynchronous jobs running.")), true},
		{lvErr(libvirt.ErrInternalError, "internal error: something else"), false},
		{lvErr(libvirt.ErrNoStoragePool, "has asynchronous jobs running"), false},
		{errors.New("pool 'p' has asynchronous jobs running."), false},
	} {
		if got := PoolBusy(tc.err); got != tc.want {
			t.Errorf("PoolBusy(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

func TestClosedMatchesErrClosed(t *testing.T) {
	t.Parallel()
	err := Classify(sshErr(sshconn.KindClosed, nil))
	if !errors.Is(err, errs.ErrClosed) || errs.Code(err) != errs.Permanent {
		t.Errorf("%v: Is(ErrClosed) = %v, Code = %v", err, errors.Is(err, errs.ErrClosed), errs.Code(err))
	}
}

// TestBareSentinelKeepsItsClass: an error wrapping a class sentinel bare
// (not through errs.WithCode) is classed already; the table does not
// replace its class.
func TestBareSentinelKeepsItsClass(t *testing.T) {
	t.Parallel()
	for _, s := range []error{errs.ErrNotFound, errs.ErrPermanent, errs.ErrTransient, errs.ErrClosed} {
		err := fmt.Errorf("step: %w (%w)", s, lvErr(libvirt.ErrInternalError, ""))
		want := errs.Code(s)
		for name, got := range map[string]error{"Classify": Classify(err), "ClassifyRead": ClassifyRead(err)} {
			if c := errs.Code(got); c != want || !errors.Is(got, s) {
				t.Errorf("%s(%v) = %v, want %v", name, err, c, want)
			}
		}
		if v := Of(err); v.Code != want {
			t.Errorf("Of(%v).Code = %v, want %v", err, v.Code, want)
		}
	}
}

// TestEntryFaultsKeepTheirClassOnReads: a fault of the entry (its link,
// credentials, host key, rights, pool) has the same class through
// ClassifyRead as through Classify; a Permanent libvirt answer about the
// object read is Transient through ClassifyRead.
func TestEntryFaultsKeepTheirClassOnReads(t *testing.T) {
	t.Parallel()
	entry := []error{
		sshErr(sshconn.KindKeyUnreadable, errors.New("open key: no such file")),
		sshErr(sshconn.KindAuthRefused, nil),
		sshErr(sshconn.KindHostUnknown, nil),
		sshErr(sshconn.KindHostKeyMismatch, nil),
		sshErr(sshconn.KindForbidden, nil),
		sshErr(sshconn.KindUnreachable, nil),
		sshErr(sshconn.KindConfig, nil),
		sshErr(sshconn.KindClosed, nil),
		fmt.Errorf("look up domain: %w", lvErr(libvirt.ErrAccessDenied, "access denied")),
		fmt.Errorf("list domains: %w", lvErr(libvirt.ErrOperationDenied, "operation forbidden: read only access prevents this")),
		fmt.Errorf("look up pool: %w", lvErr(libvirt.ErrNoStoragePool, "")),
		fmt.Errorf("pool: %w", ErrPoolInactive),
		io.EOF,
	}
	for _, err := range entry {
		if !Of(err).Entry {
			t.Errorf("Of(%v).Entry = false, want true", err)
		}
		if c, r := errs.Code(Classify(err)), errs.Code(ClassifyRead(err)); c != r {
			t.Errorf("%v: Classify %v, ClassifyRead %v: want one class", err, c, r)
		}
	}
	object := []error{
		lvErr(libvirt.ErrInvalidArg, ""),
		lvErr(libvirt.ErrXMLError, ""),
		lvErr(libvirt.ErrOperationInvalid, "domain is not running"),
		libvirt.ErrUnsupported,
	}
	for _, err := range object {
		if Of(err).Entry {
			t.Errorf("Of(%v).Entry = true, want false", err)
		}
		if c := errs.Code(ClassifyRead(err)); c != errs.Transient {
			t.Errorf("ClassifyRead(%v) = %v, want Transient", err, c)
		}
	}
}
