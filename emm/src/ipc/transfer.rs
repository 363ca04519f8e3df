//! A [`PoolExport`] or a [`MappedExport`] between processes: its bytes and its file
//! descriptors over a Unix stream socket (`SCM_RIGHTS`), to the processes the exporter allows
//! ([`PeerPolicy`]: the same user, or a list of user ids), checked with the connecting
//! process's credentials; and from the processes the importer allows, checked the same way
//! before anything is read.
//!
//! A pool export is one message: its fixed-length descriptor with its one file descriptor. A
//! mapped export is its descriptor's length (4 bytes, little-endian) and the descriptor,
//! carrying the first [`FDS_PER_MESSAGE`] file descriptors, then one byte per further batch of
//! as many.
#![allow(unsafe_code)]

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use crate::contract::mapped_export::{MAX_DESCRIPTOR_LEN, MappedExport};
use crate::contract::pool_export::{POOL_DESCRIPTOR_LEN, PoolExport};

/// `sendmsg` flags: on Linux, a closed peer is an error rather than a SIGPIPE. Elsewhere the
/// flag does not exist; a closed peer raises SIGPIPE, which most programs ignore.
#[cfg(target_os = "linux")]
const SEND_FLAGS: libc::c_int = libc::MSG_NOSIGNAL;
#[cfg(not(target_os = "linux"))]
const SEND_FLAGS: libc::c_int = 0;

/// `recvmsg` flags: on Linux, received descriptors are close-on-exec from the start; elsewhere
/// [`PoolExport::receive`] sets the flag right after.
#[cfg(target_os = "linux")]
const RECV_FLAGS: libc::c_int = libc::MSG_CMSG_CLOEXEC;
#[cfg(not(target_os = "linux"))]
const RECV_FLAGS: libc::c_int = 0;
use crate::error::EmmError;

/// Which processes may receive an export (a pool's file descriptor reaches all of the pool's
/// memory), or, on the importing side, which processes an export is taken from: checked
/// against the credentials of the process at the other end of the socket (`SO_PEERCRED`)
/// before anything is sent, or read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PeerPolicy {
    /// Processes of the exporter's own (effective) user. The default.
    #[default]
    SameUser,
    /// The exporter's user and these user ids.
    Uids(Vec<u32>),
}

impl PeerPolicy {
    fn allows(&self, uid: u32, me: u32) -> bool {
        uid == me || matches!(self, PeerPolicy::Uids(list) if list.contains(&uid))
    }

    /// The users the policy allows, for an error's text (`me`: this process's user).
    fn users(&self, me: u32) -> String {
        match self {
            PeerPolicy::SameUser => format!("this process's user (uid {me})"),
            PeerPolicy::Uids(list) => format!("uid {me} and {list:?}"),
        }
    }
}

/// What a refused peer receives instead of an export: this marker, its own uid and the
/// exporter's (in a pool export's payload of its fixed length; as a mapped export's
/// descriptor).
const DENIED: &[u8; 7] = b"EMMDENY";
/// [`DENIED`] and the two user ids.
const DENIAL_LEN: usize = 15;

/// The most file descriptors one message carries.
const FDS_PER_MESSAGE: usize = 64;

/// The effective user id of this process.
fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The user id of the process at the other end of `socket`, as the kernel recorded it when it
/// connected.
fn peer_uid(socket: &UnixStream) -> io::Result<u32> {
    #[cfg(target_os = "linux")]
    {
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: `cred` is a writable ucred and `len` its size; the socket is open.
        let r = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&raw mut cred).cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(cred.uid)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let (mut uid, mut gid) = (0, 0);
        // SAFETY: `uid` and `gid` are writable; the socket is open.
        if unsafe { libc::getpeereid(socket.as_raw_fd(), &mut uid, &mut gid) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(uid)
    }
}

/// Binds a Unix socket at `path` that only this process's user may connect to (mode 0600): the
/// listening end for [`PoolExport::send`]. The credentials are checked again on every send,
/// so a connection made before the mode is set gains nothing.
pub fn bind_owner_only(path: impl AsRef<Path>) -> io::Result<UnixListener> {
    let listener = UnixListener::bind(path.as_ref())?;
    std::fs::set_permissions(path.as_ref(), std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Checks the process at the other end of `socket` against `policy` before an export of type
/// `kind` (`PoolExport`, `MappedExport`) goes to it. A refused process is sent `frame` of the
/// refusal (a courtesy: this side's error is what counts), and the error names both users and
/// how to allow the other.
fn admit(
    socket: &UnixStream,
    policy: &PeerPolicy,
    kind: &str,
    frame: impl FnOnce([u8; DENIAL_LEN]) -> Vec<u8>,
) -> io::Result<()> {
    let (peer, me) = (peer_uid(socket)?, my_uid());
    if policy.allows(peer, me) {
        return Ok(());
    }
    let mut refusal = [0u8; DENIAL_LEN];
    refusal[..7].copy_from_slice(DENIED);
    refusal[7..11].copy_from_slice(&peer.to_le_bytes());
    refusal[11..15].copy_from_slice(&me.to_le_bytes());
    let mut s = socket;
    let _ = s.write_all(&frame(refusal));
    tracing::warn!(
        peer,
        kind,
        "an export was refused to a process of another user"
    );
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "the connecting process runs as uid {peer}, and this export goes to {} only; allow \
             it with {kind}::send_to(socket, &PeerPolicy::Uids(vec![{peer}]))",
            policy.users(me)
        ),
    ))
}

/// Checks the process at the other end of `socket` against `policy` before an export of type
/// `kind` is taken from it: memory a process of another user sends could be anything that
/// process chose, under this process's name.
fn accept_sender(socket: &UnixStream, policy: &PeerPolicy, kind: &str) -> io::Result<()> {
    sender_allowed(peer_uid(socket)?, my_uid(), policy, kind)
}

/// Whether an export of type `kind` from a process of `peer` is taken by this process of `me`
/// under `policy`; the error names both users and how to allow the sender.
fn sender_allowed(peer: u32, me: u32, policy: &PeerPolicy, kind: &str) -> io::Result<()> {
    if policy.allows(peer, me) {
        return Ok(());
    }
    tracing::warn!(
        peer,
        kind,
        "an export from a process of another user was refused"
    );
    Err(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "the sending process runs as uid {peer}, and this process takes a {kind} from {} \
             only; take it with {kind}::receive_from(socket, &PeerPolicy::Uids(vec![{peer}])) \
             if that user is trusted",
            policy.users(me)
        ),
    ))
}

/// The error a refused importer of `what` (`pool`, `memory`) reports, where `payload` is a
/// refusal.
fn denial(payload: &[u8], what: &str) -> Option<io::Error> {
    if !payload.starts_with(DENIED) || payload.len() < DENIAL_LEN {
        return None;
    }
    let uid = |i: usize| u32::from_le_bytes(payload[i..i + 4].try_into().expect("4 bytes"));
    Some(io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "the exporting process (uid {}) does not let this process (uid {}) import its \
             {what}; the exporter must allow it (send_to with PeerPolicy::Uids)",
            uid(11),
            uid(7)
        ),
    ))
}

/// Sends `data` (not empty) with `fds` (at most [`FDS_PER_MESSAGE`]) attached to its first
/// byte. The descriptors stay open here; the receiver gets duplicates.
fn send_with_fds(socket: &UnixStream, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    debug_assert!(!data.is_empty() && fds.len() <= FDS_PER_MESSAGE);
    let mut control = ControlBuffer::new();
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut msg = control.message(&mut iov);
    if fds.is_empty() {
        msg.msg_control = std::ptr::null_mut();
        msg.msg_controllen = 0;
    } else {
        // SAFETY: CMSG_SPACE is pure arithmetic.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(size_of_val(fds) as u32) } as _;
        // SAFETY: `msg` points at `control`, which has room for one header with
        // FDS_PER_MESSAGE ints (and is aligned for cmsghdr), and `msg_controllen` is
        // CMSG_SPACE of `fds.len()` ints, no more: CMSG_FIRSTHDR returns a valid, writable
        // header and CMSG_DATA room for `fds.len()` ints.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            if cmsg.is_null() {
                return Err(io::Error::other("no room for the control message"));
            }
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size_of_val(fds) as u32) as _;
            let out = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
            for (k, &fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(out.add(k), fd);
            }
        }
    }
    let sent = loop {
        // SAFETY: `msg` and everything it points at (`iov`, `data`, `control`) are alive and
        // initialised for the call; the socket is open (borrowed from `socket`).
        let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &raw const msg, SEND_FLAGS) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // The descriptors went with the first byte; the rest of the data follows plainly.
    if sent < data.len() {
        let mut rest = socket;
        rest.write_all(&data[sent..])?;
    }
    Ok(())
}

/// Receives `data.len()` bytes and the descriptors attached to the first of them (the caller
/// owns them, close-on-exec). Blocks until they arrive (or the socket's read timeout passes).
fn recv_with_fds(socket: &UnixStream, data: &mut [u8]) -> io::Result<Vec<OwnedFd>> {
    let mut control = ControlBuffer::new();
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    let mut msg = control.message(&mut iov);
    let received = loop {
        // SAFETY: `msg` points at `data` and `control`, both writable for their stated lengths
        // for the call; the socket is open (borrowed from `socket`).
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, RECV_FLAGS) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // Take ownership of every descriptor that arrived first, so none leaks on an error.
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR / CMSG_NXTHDR walk only within
    // `msg_controllen` bytes of `control`; each SCM_RIGHTS header's data holds
    // (cmsg_len - CMSG_LEN(0)) / size_of::<c_int>() descriptors, now owned by this process.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for k in 0..bytes / size_of::<libc::c_int>() {
                    let raw = std::ptr::read_unaligned(data.add(k));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
        }
    }
    #[cfg(not(target_os = "linux"))]
    for fd in &fds {
        // SAFETY: `fd` is an open descriptor this process owns (received just above).
        unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other(format!(
            "the control message was truncated (more than {FDS_PER_MESSAGE} descriptors in one \
             message)"
        )));
    }
    if received == 0 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    // A stream socket may deliver the data in pieces; the descriptors came with the first.
    if received < data.len() {
        let mut rest = socket;
        rest.read_exact(&mut data[received..])?;
    }
    Ok(fds)
}

impl PoolExport {
    /// Sends the export over a connected Unix stream socket to a process of this user: the
    /// descriptor's bytes as data, the file descriptor as `SCM_RIGHTS`. The receiving process
    /// calls [`receive`](Self::receive). This export keeps its own descriptor (the receiver
    /// gets a duplicate). A process of another user is refused, on both sides; allow others
    /// with [`send_to`](Self::send_to).
    pub fn send(&self, socket: &UnixStream) -> Result<(), EmmError> {
        self.send_to(socket, &PeerPolicy::SameUser)
    }

    /// As [`send`](Self::send), to the processes `policy` allows. A refused process gets a
    /// message that says so (its [`receive`](Self::receive) fails with it), and this call
    /// fails with [`EmmError::PoolTransfer`] naming both users.
    pub fn send_to(&self, socket: &UnixStream, policy: &PeerPolicy) -> Result<(), EmmError> {
        let fail = |error| EmmError::PoolTransfer {
            what: "sending a pool export",
            error,
        };
        admit(socket, policy, "PoolExport", |refusal| {
            let mut payload = vec![0u8; POOL_DESCRIPTOR_LEN];
            payload[..DENIAL_LEN].copy_from_slice(&refusal);
            payload
        })
        .map_err(fail)?;
        let fd = self.fd().as_raw_fd();
        send_with_fds(socket, &self.descriptor(), &[fd]).map_err(fail)?;
        tracing::debug!(pool = %self.id(), fd, "pool export sent");
        Ok(())
    }

    /// Receives one export that [`send`](Self::send) sent over `socket` from a process of this
    /// user. Blocks until it arrives (or the socket's read timeout passes). A process of
    /// another user is refused before anything is read; take exports from others with
    /// [`receive_from`](Self::receive_from).
    pub fn receive(socket: &UnixStream) -> Result<PoolExport, EmmError> {
        Self::receive_from(socket, &PeerPolicy::SameUser)
    }

    /// As [`receive`](Self::receive), from the processes `policy` allows.
    pub fn receive_from(socket: &UnixStream, policy: &PeerPolicy) -> Result<PoolExport, EmmError> {
        let fail = |error| EmmError::PoolTransfer {
            what: "receiving a pool export",
            error,
        };
        accept_sender(socket, policy, "PoolExport").map_err(fail)?;
        let mut payload = [0u8; POOL_DESCRIPTOR_LEN];
        let fds = recv_with_fds(socket, &mut payload).map_err(fail)?;
        if let Some(refused) = denial(&payload, "pool") {
            return Err(fail(refused));
        }
        let mut fds = fds.into_iter();
        let (Some(fd), None) = (fds.next(), fds.next()) else {
            return Err(fail(io::Error::other(
                "the message did not carry exactly one file descriptor",
            )));
        };
        let export = PoolExport::from_descriptor(&payload, fd)?;
        tracing::debug!(pool = %export.id(), "pool export received");
        Ok(export)
    }
}

impl MappedExport {
    /// Sends the export over a connected Unix stream socket to a process of this user: the
    /// descriptor's bytes as data, the pieces' file descriptors as `SCM_RIGHTS`. The receiving
    /// process calls [`receive`](Self::receive). This export keeps its own descriptors (the
    /// receiver gets duplicates). A process of another user is refused, on both sides; allow
    /// others with [`send_to`](Self::send_to).
    pub fn send(&self, socket: &UnixStream) -> Result<(), EmmError> {
        self.send_to(socket, &PeerPolicy::SameUser)
    }

    /// As [`send`](Self::send), to the processes `policy` allows. A refused process gets a
    /// message that says so (its [`receive`](Self::receive) fails with it), and this call
    /// fails with [`EmmError::PoolTransfer`] naming both users.
    pub fn send_to(&self, socket: &UnixStream, policy: &PeerPolicy) -> Result<(), EmmError> {
        let fail = |error| EmmError::PoolTransfer {
            what: "sending a mapped export",
            error,
        };
        admit(socket, policy, "MappedExport", |refusal| framed(&refusal)).map_err(fail)?;
        let fds: Vec<RawFd> = self.fds().map(|fd| fd.as_raw_fd()).collect();
        let mut batches = fds.chunks(FDS_PER_MESSAGE);
        send_with_fds(
            socket,
            &framed(&self.descriptor()),
            batches.next().unwrap_or(&[]),
        )
        .map_err(fail)?;
        for batch in batches {
            send_with_fds(socket, b"+", batch).map_err(fail)?;
        }
        tracing::debug!(pieces = fds.len(), size = self.size(), "mapped export sent");
        Ok(())
    }

    /// Receives one export that [`send`](Self::send) sent over `socket` from a process of this
    /// user. Blocks until it arrives (or the socket's read timeout passes). A process of
    /// another user is refused before anything is read; take exports from others with
    /// [`receive_from`](Self::receive_from).
    pub fn receive(socket: &UnixStream) -> Result<MappedExport, EmmError> {
        Self::receive_from(socket, &PeerPolicy::SameUser)
    }

    /// As [`receive`](Self::receive), from the processes `policy` allows.
    pub fn receive_from(
        socket: &UnixStream,
        policy: &PeerPolicy,
    ) -> Result<MappedExport, EmmError> {
        let fail = |error| EmmError::PoolTransfer {
            what: "receiving a mapped export",
            error,
        };
        accept_sender(socket, policy, "MappedExport").map_err(fail)?;
        let mut len = [0u8; 4];
        let mut fds = recv_with_fds(socket, &mut len).map_err(fail)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_DESCRIPTOR_LEN {
            return Err(fail(io::Error::other(format!(
                "a descriptor of {len} bytes announced, more than an export's {MAX_DESCRIPTOR_LEN}"
            ))));
        }
        let mut descriptor = vec![0u8; len];
        let mut rest = socket;
        rest.read_exact(&mut descriptor).map_err(fail)?;
        if let Some(refused) = denial(&descriptor, "memory") {
            return Err(fail(refused));
        }
        let pieces = MappedExport::parse_descriptor(&descriptor)?.3.len();
        while fds.len() < pieces {
            let mut marker = [0u8; 1];
            let batch = recv_with_fds(socket, &mut marker).map_err(fail)?;
            if batch.is_empty() {
                return Err(fail(io::Error::other(format!(
                    "{} of the export's {pieces} file descriptors arrived, then a message \
                     without any",
                    fds.len()
                ))));
            }
            fds.extend(batch);
        }
        let export = MappedExport::from_descriptor(&descriptor, fds)?;
        tracing::debug!(pieces, size = export.size(), "mapped export received");
        Ok(export)
    }
}

/// `bytes` after their length (4 bytes, little-endian).
fn framed(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + bytes.len());
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// Room for one control message with [`FDS_PER_MESSAGE`] file descriptors, aligned for
/// `cmsghdr`.
struct ControlBuffer {
    words: [u64; 40],
}

impl ControlBuffer {
    fn new() -> ControlBuffer {
        ControlBuffer { words: [0; 40] }
    }

    fn len(&self) -> usize {
        // SAFETY: CMSG_SPACE is pure arithmetic.
        let space = unsafe { libc::CMSG_SPACE((FDS_PER_MESSAGE * size_of::<libc::c_int>()) as u32) }
            as usize;
        debug_assert!(space <= size_of::<[u64; 40]>());
        space
    }

    /// A message header over one data buffer (`iov`) and this control buffer; both must
    /// outlive its use.
    fn message(&mut self, iov: &mut libc::iovec) -> libc::msghdr {
        // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths); the fields used
        // are set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov;
        msg.msg_iovlen = 1;
        msg.msg_controllen = self.len() as _;
        msg.msg_control = self.words.as_mut_ptr().cast();
        msg
    }
}

#[cfg(all(test, not(emm_loom), not(miri)))]
mod tests {
    use super::*;
    use crate::contract::ipc::DeviceIdentity;

    /// More pieces than one message carries arrive whole and in order: each received
    /// descriptor names the file its piece's did.
    #[test]
    fn a_mapped_export_of_many_pieces_crosses_in_batches() {
        let files: Vec<std::fs::File> = (0..150).map(|_| pipe_end()).collect();
        let pieces = files
            .iter()
            .enumerate()
            .map(|(k, f)| ((k + 1) << 21, OwnedFd::from(f.try_clone().unwrap())))
            .collect();
        let source = DeviceIdentity {
            pci_domain_id: 0,
            pci_bus_id: 7,
            pci_device_id: 0,
        };
        let export = MappedExport::new(source, 4096, 1 << 20, pieces);
        let (a, b) = UnixStream::pair().unwrap();
        let sender = std::thread::spawn(move || export.send(&a).map(|()| export));
        let got = MappedExport::receive(&b).unwrap();
        let sent = sender.join().unwrap().unwrap();
        assert_eq!(got.pieces(), sent.pieces());
        assert_eq!(
            (got.offset(), got.size(), got.source()),
            (4096, 1 << 20, source)
        );
        let inode = |fd: std::os::fd::BorrowedFd<'_>| {
            std::fs::File::from(fd.try_clone_to_owned().unwrap())
                .metadata()
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
                .unwrap()
        };
        let (ours, theirs): (Vec<u64>, Vec<u64>) = (
            sent.fds().map(inode).collect(),
            got.fds().map(inode).collect(),
        );
        assert_eq!(ours, theirs);
    }

    /// A distinct file for each piece (pipes have distinct inodes).
    fn pipe_end() -> std::fs::File {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both were just opened by pipe and are owned here.
        unsafe {
            drop(OwnedFd::from_raw_fd(fds[1]));
            std::fs::File::from_raw_fd(fds[0])
        }
    }

    /// An export from a process of another user is refused before anything is read, saying
    /// who sent it and how to take it; the importer's own user and the users its policy lists
    /// are taken. (A socket pair is always of one user: the decision is tested with the users
    /// given, and `receive` itself with a pair.)
    #[test]
    fn an_export_from_another_user_is_refused_unless_allowed() {
        let e = sender_allowed(1234, 99, &PeerPolicy::SameUser, "MappedExport").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        let text = e.to_string();
        assert!(
            text.contains("uid 1234") && text.contains("uid 99") && text.contains("receive_from"),
            "{text}"
        );
        sender_allowed(99, 99, &PeerPolicy::SameUser, "MappedExport").unwrap();
        sender_allowed(1234, 99, &PeerPolicy::Uids(vec![1234]), "PoolExport").unwrap();
        assert!(sender_allowed(5, 99, &PeerPolicy::Uids(vec![1234]), "PoolExport").is_err());
        // Through a socket pair (one user), the check passes and the export is read.
        let (a, b) = UnixStream::pair().unwrap();
        accept_sender(&b, &PeerPolicy::SameUser, "MappedExport").unwrap();
        drop(a);
    }

    /// A refused importer learns why from the exporter's refusal.
    #[test]
    fn a_refused_mapped_export_says_who_may_import() {
        let refusal = framed(&{
            let mut r = [0u8; DENIAL_LEN];
            r[..7].copy_from_slice(DENIED);
            r[7..11].copy_from_slice(&1234u32.to_le_bytes());
            r[11..15].copy_from_slice(&99u32.to_le_bytes());
            r
        });
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&refusal).unwrap();
        let e = MappedExport::receive(&b).unwrap_err().to_string();
        assert!(e.contains("uid 99") && e.contains("uid 1234"), "{e}");
    }
}
