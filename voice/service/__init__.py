"""The service around the conversations: the instance (the models and the state its sessions share), the
HTTP/WebSocket server, who may connect (auth), how many (limits, capacity), who gets the cores (scheduler),
and the call records (records, recordsdb).
"""
