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

	"github.com/egressproxy/egressproxy/provider"
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
func want(n libvirt.ErrorNumber) (provider.ErrorCode, provider.HealthReason) {
	switch n {
	case libvirt.ErrNoDomain, libvirt.ErrNoStorageVol, libvirt.ErrNoDomainMetadata:
		return provider.NotFound, provider.ReasonUnknown
	case libvirt.ErrNoStoragePool:
		return provider.Permanent, provider.ReasonPoolNotFound
	case libvirt.ErrAccessDenied, libvirt.ErrAuthFailed, libvirt.ErrAuthUnavailable, libvirt.ErrAuthCancelled, libvirt.ErrOperationDenied:
		return provider.Permanent, provider.ReasonForbidden
	case libvirt.ErrInvalidArg, libvirt.ErrNoSupport, libvirt.ErrOperationInvalid, libvirt.ErrOperationUnsupported,
		libvirt.ErrArgumentUnsupported, libvirt.ErrConfigUnsupported, libvirt.ErrXMLError, libvirt.ErrXMLDetail,
		libvirt.ErrXMLInvalidSchema, libvirt.ErrDomExist, libvirt.ErrStorageVolExist, libvirt.ErrInvalidStoragePool,
		libvirt.ErrInvalidStorageVol, libvirt.ErrInvalidDomain, libvirt.ErrNoNetwork, libvirt.ErrInvalidMac,
		libvirt.ErrCPUIncompatible, libvirt.ErrNoKernel:
		return provider.Permanent, provider.ReasonUnknown
	case libvirt.ErrNoConnect, libvirt.ErrInvalidConn, libvirt.ErrRPC:
		return provider.Transient, provider.ReasonUnreachable
	}
	return provider.Transient, provider.ReasonUnknown
}

// TestEveryLibvirtNumber checks the verdict of every libvirt error number,
// bare and wrapped, through Classify, ClassifyRead and Reason.
func TestEveryLibvirtNumber(t *testing.T) {
	t.Parallel()
	for n := libvirt.ErrOk; n <= maxNumber+1; n++ {
		code, reason := want(n)
		for _, err := range []error{lvErr(n, ""), fmt.Errorf("look up: %w", lvErr(n, "")), &libvirt.Error{Code: uint32(n), Message: "pointer"}} {
			v := Of(err)
			if v.Code != code || v.Reason != reason || v.Missing != (code == provider.NotFound) {
				t.Errorf("Of(%d %v) = %+v, want %v %v", n, err, v, code, reason)
			}
			got := Classify(err)
			if c := provider.Code(got); c != code {
				t.Errorf("Classify(%d) = %v, want %v", n, c, code)
			}
			if !errors.Is(got, err) {
				t.Errorf("Classify(%d) lost its cause", n)
			}
			wantRead := code
			if code == provider.Permanent {
				wantRead = provider.Transient
			}
			if c := provider.Code(ClassifyRead(err)); c != wantRead {
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
	return &sshconn.Error{Kind: k, Addr: "127.0.0.1:22", Op: "test", Err: inner}
}

func TestShapes(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		err    error
		code   provider.ErrorCode
		reason provider.HealthReason
		read   provider.ErrorCode // ClassifyRead; zero: same as code
	}{
		{"nil", nil, provider.OK, provider.ReasonNone, 0},
		{"explicit class wins", provider.WithCode(provider.Transient, lvErr(libvirt.ErrNoDomain, "")), provider.Transient, provider.ReasonUnknown, 0},
		{"explicit class keeps the reason of its cause", provider.WithCode(provider.Permanent, sshErr(sshconn.KindAuthRefused, nil)), provider.Permanent, provider.ReasonUnauthorized, provider.Permanent},
		{"canceled", fmt.Errorf("call: %w", context.Canceled), provider.Canceled, provider.ReasonUnknown, 0},
		{"deadline inside unreachable", sshErr(sshconn.KindUnreachable, context.DeadlineExceeded), provider.DeadlineExceeded, provider.ReasonUnknown, 0},
		{"our DialTimeout inside unreachable", sshErr(sshconn.KindUnreachable, fmt.Errorf("%w (i/o timeout)", &sshconn.TimeoutError{Budget: "DialTimeout", After: time.Second})), provider.Transient, provider.ReasonUnreachable, 0},
		{"our CallTimeout bare", fmt.Errorf("step: %w", &sshconn.TimeoutError{Budget: "CallTimeout", After: time.Second}), provider.Transient, provider.ReasonUnreachable, 0},
		{"unreachable wraps access denied", sshErr(sshconn.KindUnreachable, lvErr(libvirt.ErrAccessDenied, "")), provider.Transient, provider.ReasonUnreachable, 0},
		{"ssh closed", sshErr(sshconn.KindClosed, nil), provider.Permanent, provider.ReasonUnknown, provider.Permanent},
		{"ssh config", sshErr(sshconn.KindConfig, nil), provider.Permanent, provider.ReasonUnknown, provider.Transient},
		{"key unreadable", sshErr(sshconn.KindKeyUnreadable, nil), provider.Permanent, provider.ReasonCredentialsUnavailable, provider.Transient},
		{"auth refused", sshErr(sshconn.KindAuthRefused, nil), provider.Permanent, provider.ReasonUnauthorized, provider.Transient},
		{"host unknown", sshErr(sshconn.KindHostUnknown, nil), provider.Permanent, provider.ReasonHostKeyUnknown, provider.Transient},
		{"host key mismatch", sshErr(sshconn.KindHostKeyMismatch, nil), provider.Permanent, provider.ReasonHostKeyMismatch, provider.Transient},
		{"socket forbidden", sshErr(sshconn.KindForbidden, nil), provider.Transient, provider.ReasonForbidden, 0},
		{"EINVAL after disconnect", fmt.Errorf("state: %w", syscall.EINVAL), provider.Transient, provider.ReasonUnreachable, 0},
		{"interrupted", libvirt.ErrInterrupted, provider.Transient, provider.ReasonUnreachable, 0},
		{"eof", io.EOF, provider.Transient, provider.ReasonUnreachable, 0},
		{"pool marker", fmt.Errorf("pool %q is inactive: %w", "p", ErrPoolInactive), provider.Permanent, provider.ReasonPoolNotActive, provider.Transient},
		{"libvirt pool not active", lvErr(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool 'p' is not active"), provider.Permanent, provider.ReasonPoolNotActive, provider.Transient},
		{"pool busy", lvErr(libvirt.ErrOperationInvalid, "Requested operation is not valid: storage pool 'p' has asynchronous jobs running."), provider.Transient, provider.ReasonUnknown, 0},
		{"procedure unsupported", libvirt.ErrUnsupported, provider.Permanent, provider.ReasonUnknown, provider.Transient},
		{"plain", errors.New("odd"), provider.Transient, provider.ReasonUnknown, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if c := provider.Code(Classify(tt.err)); c != tt.code {
				t.Errorf("Classify = %v, want %v", c, tt.code)
			}
			read := tt.read
			if read == 0 {
				read = tt.code
			}
			if c := provider.Code(ClassifyRead(tt.err)); c != read {
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
	if !errors.Is(err, provider.ErrClosed) || provider.Code(err) != provider.Permanent {
		t.Errorf("%v: Is(ErrClosed) = %v, Code = %v", err, errors.Is(err, provider.ErrClosed), provider.Code(err))
	}
}

// TestBareSentinelKeepsItsClass: an error wrapping a class sentinel bare
// (not through provider.WithCode) is classed already; the table does not
// replace its class.
func TestBareSentinelKeepsItsClass(t *testing.T) {
	t.Parallel()
	for _, s := range []error{provider.ErrNotFound, provider.ErrPermanent, provider.ErrTransient, provider.ErrClosed} {
		err := fmt.Errorf("step: %w (%w)", s, lvErr(libvirt.ErrInternalError, ""))
		want := provider.Code(s)
		for name, got := range map[string]error{"Classify": Classify(err), "ClassifyRead": ClassifyRead(err)} {
			if c := provider.Code(got); c != want || !errors.Is(got, s) {
				t.Errorf("%s(%v) = %v, want %v", name, err, c, want)
			}
		}
		if v := Of(err); v.Code != want {
			t.Errorf("Of(%v).Code = %v, want %v", err, v.Code, want)
		}
	}
}
