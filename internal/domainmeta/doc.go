// Package domainmeta decodes the library's own metadata element in a libvirt
// domain's XML (namespace Namespace): the one decoding and check of it,
// which kvm2 reads every domain with and internal/benchutil decodes domains
// with as kvm2 does. kvm2 writes the element (kvm2/domain.go
// marshalMetadata).
package domainmeta
