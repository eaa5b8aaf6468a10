"""What both ends of the store share: the message protocol (:mod:`.protocol`), the bulk lane's
framing (:mod:`.lane`) and the checked copies and receives (:mod:`.copies`, :mod:`.native`)."""
